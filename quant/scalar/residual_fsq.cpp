#include "quant/scalar/residual_fsq.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/scalar/scalar_common.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void fail(const std::string& who, const std::string& what) {
  throw std::invalid_argument("[" + who + "] " + what);
}

}  // namespace

ResidualFSQ::ResidualFSQ(ResidualFSQOptions opts)
    : Module("ResidualFSQ"),
      opts_(std::move(opts)),
      dropout_gen_(StepStream(Generator::named(opts_.fsq.seed, "rfsq.quantize_dropout"))) {
  if (opts_.num_quantizers < 1)
    fail("ResidualFSQ", "num_quantizers must be >= 1, got " + std::to_string(opts_.num_quantizers));
  if (opts_.fsq.num_codebooks != 1) fail("ResidualFSQ", "num_codebooks must be 1");
  const auto& L = opts_.fsq.levels;
  const int64_t d = static_cast<int64_t>(L.size());
  if (d == 0) fail("ResidualFSQ", "levels must not be empty");
  dim_ = opts_.fsq.dim > 0 ? opts_.fsq.dim : d;
  Generator init = Generator::named(opts_.fsq.seed, "rfsq.init");
  if (dim_ != d) {
    project_in_ = register_module(
        "project_in", std::make_shared<Linear>(dim_, d, init, opts_.fsq.projection_has_bias));
    project_out_ = register_module(
        "project_out", std::make_shared<Linear>(d, dim_, init, opts_.fsq.projection_has_bias));
  }
  auto list = register_module("layers", std::make_shared<Module>("ModuleList"));
  std::vector<double> scales;
  for (int64_t q = 0; q < opts_.num_quantizers; ++q) {
    FSQOptions lo = opts_.fsq;
    lo.dim = d;
    lo.channel_first = false;
    lo.preserve_symmetry = true;
    lo.seed = detail::child_seed(opts_.fsq.seed, "layer" + std::to_string(q));
    layers_.push_back(list->register_module(std::to_string(q), std::make_shared<FSQ>(lo)));
    for (int64_t l : L) scales.push_back(std::pow(double(l), -double(q)));
  }
  scales_ = register_buffer(
      "scales", from_vector<double>(scales, {opts_.num_quantizers, d}).to(DType::f32), false);
  std::vector<double> clampv;
  if (opts_.soft_clamp_input_value)
    clampv.assign(static_cast<size_t>(d), *opts_.soft_clamp_input_value);
  else if (opts_.fsq.bound_hard_clamp)
    for (int64_t l : L) clampv.push_back(1.0 + 1.0 / double(l - 1));
  if (!clampv.empty()) soft_clamp_ = from_vector<double>(clampv, {d}).to(DType::f32);
}

int64_t ResidualFSQ::draw_dropout() {
  return detail::draw_dropout_layer(dropout_gen_.next(), num_quantizers(),
                                    opts_.quantize_dropout_cutoff_index,
                                    opts_.quantize_dropout_multiple_of);
}

QuantizeOutput ResidualFSQ::forward(const Tensor& x, const Tensor& mask) {
  // Dropout only where it can matter for training: train mode with grad on
  // (an eval or no-grad forward draws nothing, so it cannot shift the stream).
  const bool drop =
      opts_.quantize_dropout && is_training() && grad_enabled() && num_quantizers() > 1;
  return forward_keep(x, mask, drop ? draw_dropout() : -1);
}

Tensor ResidualFSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

QuantizeOutput ResidualFSQ::forward_keep(const Tensor& x, const Tensor& mask, int64_t last_kept) {
  const TokenLayout layout(x, !opts_.fsq.channel_first, dim_, "ResidualFSQ");
  (void)detail::token_mask(mask, layout, "ResidualFSQ");
  Tensor z = layout.to_tokens(x);
  if (project_in_) z = project_in_->forward(z);
  if (soft_clamp_.defined()) z = detail::soft_clamp(z, soft_clamp_.to(z.dtype()));
  Tensor residual = z;
  std::vector<Tensor> indices, outputs;  // outputs summed once (add_n)
  const int64_t Q = num_quantizers();
  for (int64_t q = 0; q < Q; ++q) {
    if (last_kept >= 0 && q > last_kept) {
      indices.push_back(full({layout.batch(), layout.tokens()}, -1.0, {.dtype = DType::i32}));
      continue;
    }
    const Tensor scale = select(scales_, 0, q).to(z.dtype());
    const QuantizeOutput o = layers_[q]->forward(residual / scale, Tensor());
    const Tensor qz = o.quantized * scale;
    residual = residual - qz.detach();
    outputs.push_back(qz);
    indices.push_back(o.indices.to(DType::i32));
  }
  Tensor out = add_n(outputs);
  if (project_out_) out = project_out_->forward(out);
  QuantizeOutput r;
  r.quantized = layout.from_tokens(out);
  r.indices = layout.spatial_from_tokens(stack(indices, -1));
  r.loss = zeros({}, options_of(r.quantized));
  return r;
}

Tensor ResidualFSQ::get_codes_from_indices(const Tensor& indices) const {
  const int64_t Q = num_quantizers();
  if (indices.dim() < 1 || indices.size(-1) != Q)
    fail("ResidualFSQ", "indices must end in num_quantizers = " + std::to_string(Q) + ", got " +
                            shape_str(indices.shape()));
  std::vector<Tensor> codes;
  for (int64_t q = 0; q < Q; ++q) {
    const Tensor idx = select(indices, -1, q).to(DType::i64);
    const Tensor dropped = lt(idx, zeros({}, {.dtype = DType::i64}));
    // Dropped layers (-1) look up code 0 and are zeroed afterwards.
    const Tensor safe = where(dropped, zeros({}, {.dtype = DType::i64}), idx);
    const Tensor c = layers_[q]->indices_to_grid_codes(safe) * select(scales_, 0, q);
    codes.push_back(masked_fill(c, unsqueeze(dropped, -1), 0.0));
  }
  return stack(codes, 0);
}

Tensor ResidualFSQ::get_output_from_indices(const Tensor& indices) const {
  Tensor out = sum(get_codes_from_indices(indices), {0});
  if (project_out_) out = project_out_->forward(out);
  return out;
}

Tensor ResidualFSQ::codebooks() const {
  std::vector<Tensor> books;
  for (const auto& l : layers_) books.push_back(l->implicit_codebook());
  return stack(books, 0);
}

GroupedResidualFSQ::GroupedResidualFSQ(GroupedResidualFSQOptions opts)
    : Module("GroupedResidualFSQ"), opts_(std::move(opts)) {
  const int64_t dim = opts_.rfsq.fsq.dim;
  if (opts_.groups < 1 || dim <= 0 || dim % opts_.groups != 0)
    fail("GroupedResidualFSQ", "dim (" + std::to_string(dim) +
                                   ") must be a positive multiple of groups (" +
                                   std::to_string(opts_.groups) + ")");
  auto list = register_module("rvqs", std::make_shared<Module>("ModuleList"));
  for (int64_t g = 0; g < opts_.groups; ++g) {
    ResidualFSQOptions o = opts_.rfsq;
    o.fsq.dim = dim / opts_.groups;
    o.fsq.channel_first = false;
    o.fsq.seed = detail::child_seed(opts_.rfsq.fsq.seed, "group" + std::to_string(g));
    rfsqs_.push_back(list->register_module(std::to_string(g), std::make_shared<ResidualFSQ>(o)));
  }
}

QuantizeOutput GroupedResidualFSQ::forward(const Tensor& x, const Tensor& mask) {
  const TokenLayout layout(x, !opts_.rfsq.fsq.channel_first, opts_.rfsq.fsq.dim,
                           "GroupedResidualFSQ");
  const Tensor m = detail::token_mask(mask, layout, "GroupedResidualFSQ");
  const bool drop = opts_.rfsq.quantize_dropout && is_training() && grad_enabled() &&
                    rfsqs_.front()->num_quantizers() > 1;
  const int64_t last_kept = drop ? rfsqs_.front()->draw_dropout() : -1;
  const std::vector<Tensor> parts = chunk(layout.to_tokens(x), groups(), -1);
  std::vector<Tensor> outs, indices;
  for (int64_t g = 0; g < groups(); ++g) {
    QuantizeOutput o = rfsqs_[g]->forward_keep(parts[g], m, last_kept);
    outs.push_back(o.quantized);
    indices.push_back(layout.spatial_from_tokens(o.indices));
  }
  QuantizeOutput r;
  r.quantized = layout.from_tokens(cat(outs, -1));
  r.indices = stack(indices, 0);
  r.loss = zeros({}, options_of(r.quantized));
  return r;
}

Tensor GroupedResidualFSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

Tensor GroupedResidualFSQ::get_codes_from_indices(const Tensor& indices) const {
  std::vector<Tensor> codes;
  for (int64_t g = 0; g < groups(); ++g)
    codes.push_back(rfsqs_[g]->get_codes_from_indices(select(indices, 0, g)));
  return stack(codes, 0);
}

Tensor GroupedResidualFSQ::get_output_from_indices(const Tensor& indices) const {
  std::vector<Tensor> outs;
  for (int64_t g = 0; g < groups(); ++g)
    outs.push_back(rfsqs_[g]->get_output_from_indices(select(indices, 0, g)));
  return cat(outs, -1);
}

}  // namespace quanta::quant
