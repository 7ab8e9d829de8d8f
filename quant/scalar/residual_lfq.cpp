#include "quant/scalar/residual_lfq.h"

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

ResidualLFQ::ResidualLFQ(ResidualLFQOptions opts)
    : Module("ResidualLFQ"),
      opts_(std::move(opts)),
      dropout_gen_(StepStream(Generator::named(opts_.lfq.seed, "rlfq.quantize_dropout"))) {
  if (opts_.num_quantizers < 1)
    fail("ResidualLFQ", "num_quantizers must be >= 1, got " + std::to_string(opts_.num_quantizers));
  if (opts_.lfq.num_codebooks != 1) fail("ResidualLFQ", "num_codebooks must be 1");
  // The layer geometry, from one probe layer without projections.
  LFQOptions probe = opts_.lfq;
  probe.has_projections = false;
  probe.dim = 0;
  if (probe.codebook_size == 0) {
    if (opts_.lfq.dim <= 0) fail("ResidualLFQ", "give dim or codebook_size");
    probe.dim = opts_.lfq.dim;
  }
  const int64_t d = LFQ(probe).codebook_dim();
  dim_ = opts_.lfq.dim > 0 ? opts_.lfq.dim : d;
  Generator init = Generator::named(opts_.lfq.seed, "rlfq.init");
  if (dim_ != d) {
    project_in_ = register_module(
        "project_in", std::make_shared<Linear>(dim_, d, init, opts_.lfq.projection_has_bias));
    project_out_ = register_module(
        "project_out", std::make_shared<Linear>(d, dim_, init, opts_.lfq.projection_has_bias));
  }
  auto list = register_module("layers", std::make_shared<Module>("ModuleList"));
  for (int64_t q = 0; q < opts_.num_quantizers; ++q) {
    LFQOptions lo = opts_.lfq;
    lo.dim = d;
    lo.codebook_size = int64_t{1} << d;
    lo.has_projections = false;
    lo.channel_first = false;
    lo.codebook_scale = opts_.lfq.codebook_scale * std::ldexp(1.0, -int(q));
    lo.soft_clamp_input_value = opts_.lfq.soft_clamp_input_value * std::ldexp(1.0, -int(q));
    lo.seed = detail::child_seed(opts_.lfq.seed, "layer" + std::to_string(q));
    layers_.push_back(list->register_module(std::to_string(q), std::make_shared<LFQ>(lo)));
  }
}

void ResidualLFQ::set_token_mean(const TokenMean& fn) {
  for (auto& l : layers_) l->token_mean = fn;
}

int64_t ResidualLFQ::draw_dropout() {
  return detail::draw_dropout_layer(dropout_gen_.next(), num_quantizers(),
                                    opts_.quantize_dropout_cutoff_index,
                                    opts_.quantize_dropout_multiple_of);
}

QuantizeOutput ResidualLFQ::forward(const Tensor& x, const Tensor& mask, double inv_temperature) {
  const bool drop =
      opts_.quantize_dropout && is_training() && grad_enabled() && num_quantizers() > 1;
  return forward_keep(x, mask, inv_temperature, drop ? draw_dropout() : -1);
}

Tensor ResidualLFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

QuantizeOutput ResidualLFQ::forward_keep(const Tensor& x, const Tensor& mask,
                                         double inv_temperature, int64_t last_kept) {
  const TokenLayout layout(x, !opts_.lfq.channel_first, dim_, "ResidualLFQ");
  const Tensor keep = detail::token_mask(mask, layout, "ResidualLFQ");
  Tensor z = layout.to_tokens(x);
  if (project_in_) z = project_in_->forward(z);
  Tensor residual = z;
  std::vector<Tensor> indices, losses, outputs;  // outputs summed once (add_n)
  LossTerms terms;
  for (int64_t q = 0; q < num_quantizers(); ++q) {
    if (last_kept >= 0 && q > last_kept) {
      indices.push_back(full({layout.batch(), layout.tokens()}, -1.0, {.dtype = DType::i64}));
      losses.push_back(zeros({}, options_of(z)));
      continue;
    }
    const QuantizeOutput o = layers_[q]->forward(residual, keep, inv_temperature);
    residual = residual - o.quantized.detach();
    outputs.push_back(o.quantized);
    indices.push_back(o.indices);
    losses.push_back(o.loss);
    if (terms.empty()) {
      terms = o.losses;
    } else {
      for (size_t i = 0; i < terms.size(); ++i)
        terms[i].second = terms[i].second + o.losses[i].second;
    }
  }
  Tensor out = add_n(outputs);
  if (project_out_) out = project_out_->forward(out);
  QuantizeOutput r;
  r.quantized = layout.from_tokens(out);
  r.indices = layout.spatial_from_tokens(stack(indices, -1));
  r.loss = stack(losses, 0);
  r.losses = terms;
  return r;
}

Tensor ResidualLFQ::get_codes_from_indices(const Tensor& indices) const {
  const int64_t Q = num_quantizers();
  if (indices.dim() < 1 || indices.size(-1) != Q)
    fail("ResidualLFQ", "indices must end in num_quantizers = " + std::to_string(Q) + ", got " +
                            shape_str(indices.shape()));
  std::vector<Tensor> codes;
  for (int64_t q = 0; q < Q; ++q) {
    const Tensor idx = select(indices, -1, q).to(DType::i64);
    const Tensor dropped = lt(idx, zeros({}, {.dtype = DType::i64}));
    const Tensor safe = where(dropped, zeros({}, {.dtype = DType::i64}), idx);
    const Tensor c = layers_[q]->indices_to_grid_codes(safe);
    codes.push_back(masked_fill(c, unsqueeze(dropped, -1), 0.0));
  }
  return stack(codes, 0);
}

Tensor ResidualLFQ::get_output_from_indices(const Tensor& indices) const {
  Tensor out = sum(get_codes_from_indices(indices), {0});
  if (project_out_) out = project_out_->forward(out);
  return out;
}

Tensor ResidualLFQ::codebooks() const {
  std::vector<Tensor> books;
  for (const auto& l : layers_) books.push_back(l->codebook());
  return stack(books, 0);
}

GroupedResidualLFQ::GroupedResidualLFQ(GroupedResidualLFQOptions opts)
    : Module("GroupedResidualLFQ"), opts_(std::move(opts)) {
  const int64_t dim = opts_.rlfq.lfq.dim;
  if (opts_.groups < 1 || dim <= 0 || dim % opts_.groups != 0)
    fail("GroupedResidualLFQ", "dim (" + std::to_string(dim) +
                                   ") must be a positive multiple of groups (" +
                                   std::to_string(opts_.groups) + ")");
  auto list = register_module("rvqs", std::make_shared<Module>("ModuleList"));
  for (int64_t g = 0; g < opts_.groups; ++g) {
    ResidualLFQOptions o = opts_.rlfq;
    o.lfq.dim = dim / opts_.groups;
    o.lfq.channel_first = false;
    o.lfq.seed = detail::child_seed(opts_.rlfq.lfq.seed, "group" + std::to_string(g));
    rlfqs_.push_back(list->register_module(std::to_string(g), std::make_shared<ResidualLFQ>(o)));
  }
}

QuantizeOutput GroupedResidualLFQ::forward(const Tensor& x, const Tensor& mask,
                                           double inv_temperature) {
  const TokenLayout layout(x, !opts_.rlfq.lfq.channel_first, opts_.rlfq.lfq.dim,
                           "GroupedResidualLFQ");
  const Tensor m = detail::token_mask(mask, layout, "GroupedResidualLFQ");
  const bool drop = opts_.rlfq.quantize_dropout && is_training() && grad_enabled() &&
                    rlfqs_.front()->num_quantizers() > 1;
  const int64_t last_kept = drop ? rlfqs_.front()->draw_dropout() : -1;
  const std::vector<Tensor> parts = chunk(layout.to_tokens(x), groups(), -1);
  std::vector<Tensor> outs, indices, losses;
  LossTerms terms;
  for (int64_t g = 0; g < groups(); ++g) {
    QuantizeOutput o = rlfqs_[g]->forward_keep(parts[g], m, inv_temperature, last_kept);
    outs.push_back(o.quantized);
    indices.push_back(layout.spatial_from_tokens(o.indices));
    losses.push_back(o.loss);
    if (terms.empty()) {
      terms = o.losses;
    } else {
      for (size_t i = 0; i < terms.size(); ++i)
        terms[i].second = terms[i].second + o.losses[i].second;
    }
  }
  QuantizeOutput r;
  r.quantized = layout.from_tokens(cat(outs, -1));
  r.indices = stack(indices, 0);
  r.loss = stack(losses, 0);
  r.losses = terms;
  return r;
}

Tensor GroupedResidualLFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

Tensor GroupedResidualLFQ::get_codes_from_indices(const Tensor& indices) const {
  std::vector<Tensor> codes;
  for (int64_t g = 0; g < groups(); ++g)
    codes.push_back(rlfqs_[g]->get_codes_from_indices(select(indices, 0, g)));
  return stack(codes, 0);
}

Tensor GroupedResidualLFQ::get_output_from_indices(const Tensor& indices) const {
  std::vector<Tensor> outs;
  for (int64_t g = 0; g < groups(); ++g)
    outs.push_back(rlfqs_[g]->get_output_from_indices(select(indices, 0, g)));
  return cat(outs, -1);
}

}  // namespace quanta::quant
