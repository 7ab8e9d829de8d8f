#include "quant/scalar/residual_fsq.h"

#include <cmath>
#include <stdexcept>
#include <string>

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

[[noreturn]] void residual_fsq_fail(const std::string& who, const std::string& what) {
  throw std::invalid_argument("[" + who + "] " + what);
}

}  // namespace

ResidualFSQ::ResidualFSQ(ResidualFSQOptions opts, Generator& gen)
    : ResidualFSQ(std::move(opts), draw_seed(gen)) {}

ResidualFSQ::ResidualFSQ(ResidualFSQOptions opts, uint64_t seed)
    : Residual("ResidualFSQ", {opts.quantize_dropout, opts.quantize_dropout_cutoff_index,
                               opts.quantize_dropout_multiple_of}),
      opts_(std::move(opts)) {
  seed_dropout(Generator::named(seed, "rfsq.quantize_dropout"));
  if (opts_.num_quantizers < 1)
    residual_fsq_fail("ResidualFSQ",
                      "num_quantizers must be >= 1, got " + std::to_string(opts_.num_quantizers));
  if (opts_.fsq.num_codebooks != 1) residual_fsq_fail("ResidualFSQ", "num_codebooks must be 1");
  quantize_dropout().check("ResidualFSQ", opts_.num_quantizers);
  const auto& L = opts_.fsq.levels;
  const int64_t d = static_cast<int64_t>(L.size());
  if (d == 0) residual_fsq_fail("ResidualFSQ", "levels must not be empty");
  dim_ = opts_.fsq.dim > 0 ? opts_.fsq.dim : d;
  Generator init = Generator::named(seed, "rfsq.init");
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
    layers_.push_back(list->register_module(
        std::to_string(q),
        std::shared_ptr<FSQ>(new FSQ(lo, detail::child_seed(seed, "layer" + std::to_string(q))))));
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

Tensor ResidualFSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

QuantizeOutput ResidualFSQ::forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                                         const QuantizeOptions&) {
  const TokenLayout layout(x, !opts_.fsq.channel_first, dim_, "ResidualFSQ");
  (void)detail::token_mask(mask, layout, "ResidualFSQ");
  return quantize_tokens(layout, x, project_in_.get(), project_out_.get(), [&](Tensor z) {
    if (soft_clamp_.defined()) z = detail::soft_clamp(z, soft_clamp_.to(z.dtype()));
    return residual_quantize(z, num_quantizers(), last_kept, DType::i32, MemberLosses::none,
                             [&](int64_t q, const Tensor& residual) {
                               const Tensor scale = select(scales_, 0, q).to(z.dtype());
                               QuantizeOutput o = layers_[q]->forward(residual / scale, Tensor());
                               o.quantized = o.quantized * scale;
                               return o;
                             });
  });
}

Tensor ResidualFSQ::get_codes_from_indices(const Tensor& indices) {
  return residual_codes(
      indices, num_quantizers(),
      [&](int64_t q, const Tensor& idx) {
        return layers_[q]->indices_to_grid_codes(idx) * select(scales_, 0, q);
      },
      "ResidualFSQ");
}

Tensor ResidualFSQ::get_output_from_indices(const Tensor& indices) {
  Tensor out = sum(get_codes_from_indices(indices), {0});
  if (project_out_) out = project_out_->forward(out);
  return out;
}

Tensor ResidualFSQ::codebooks() const {
  std::vector<Tensor> books;
  for (const auto& l : layers_) books.push_back(l->implicit_codebook());
  return stack(books, 0);
}

GroupedResidualFSQ::GroupedResidualFSQ(GroupedResidualFSQOptions opts, Generator& gen)
    : Grouped("GroupedResidualFSQ", {.dim = opts.rfsq.fsq.dim,
                                     .groups = opts.groups,
                                     .channel_last = !opts.rfsq.fsq.channel_first,
                                     .accept_image_fmap = true,
                                     .losses = MemberLosses::none}) {
  const uint64_t seed = draw_seed(gen);
  for (int64_t g = 0; g < opts.groups; ++g) {
    ResidualFSQOptions o = opts.rfsq;
    o.fsq.dim = opts.rfsq.fsq.dim / opts.groups;
    o.fsq.channel_first = false;
    add_group(std::shared_ptr<ResidualFSQ>(
        new ResidualFSQ(o, detail::child_seed(seed, "group" + std::to_string(g)))));
  }
}

Tensor GroupedResidualFSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
