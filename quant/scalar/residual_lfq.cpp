#include "quant/scalar/residual_lfq.h"

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

[[noreturn]] void residual_lfq_fail(const std::string& who, const std::string& what) {
  throw std::invalid_argument("[" + who + "] " + what);
}

}  // namespace

ResidualLFQ::ResidualLFQ(ResidualLFQOptions opts, Generator& gen)
    : ResidualLFQ(std::move(opts), draw_seed(gen)) {}

ResidualLFQ::ResidualLFQ(ResidualLFQOptions opts, uint64_t seed)
    : Residual("ResidualLFQ", {opts.quantize_dropout, opts.quantize_dropout_cutoff_index,
                               opts.quantize_dropout_multiple_of}),
      opts_(std::move(opts)) {
  seed_dropout(Generator::named(seed, "rlfq.quantize_dropout"));
  if (opts_.num_quantizers < 1)
    residual_lfq_fail("ResidualLFQ",
                      "num_quantizers must be >= 1, got " + std::to_string(opts_.num_quantizers));
  if (opts_.lfq.num_codebooks != 1) residual_lfq_fail("ResidualLFQ", "num_codebooks must be 1");
  quantize_dropout().check("ResidualLFQ", opts_.num_quantizers);
  // The layer geometry, from one probe layer without projections.
  LFQOptions probe = opts_.lfq;
  probe.has_projections = false;
  probe.dim = 0;
  if (probe.codebook_size == 0) {
    if (opts_.lfq.dim <= 0) residual_lfq_fail("ResidualLFQ", "give dim or codebook_size");
    probe.dim = opts_.lfq.dim;
  }
  const int64_t d = LFQ(probe, seed).codebook_dim();
  dim_ = opts_.lfq.dim > 0 ? opts_.lfq.dim : d;
  Generator init = Generator::named(seed, "rlfq.init");
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
    layers_.push_back(list->register_module(
        std::to_string(q),
        std::shared_ptr<LFQ>(new LFQ(lo, detail::child_seed(seed, "layer" + std::to_string(q))))));
  }
}

void ResidualLFQ::set_token_mean(const TokenMean& fn) {
  for (auto& l : layers_) l->token_mean = fn;
}

Tensor ResidualLFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

QuantizeOutput ResidualLFQ::forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                                         const QuantizeOptions& opts) {
  const TokenLayout layout(x, !opts_.lfq.channel_first, dim_, "ResidualLFQ");
  const Tensor keep = detail::token_mask(mask, layout, "ResidualLFQ");
  return quantize_tokens(layout, x, project_in_.get(), project_out_.get(), [&](const Tensor& z) {
    return residual_quantize(z, num_quantizers(), last_kept, DType::i64, MemberLosses::summed,
                             [&](int64_t q, const Tensor& residual) {
                               return layers_[q]->forward(residual, keep, opts.inv_temperature);
                             });
  });
}

Tensor ResidualLFQ::get_codes_from_indices(const Tensor& indices) {
  return residual_codes(
      indices, num_quantizers(),
      [&](int64_t q, const Tensor& idx) { return layers_[q]->indices_to_grid_codes(idx); },
      "ResidualLFQ");
}

Tensor ResidualLFQ::get_output_from_indices(const Tensor& indices) {
  Tensor out = sum(get_codes_from_indices(indices), {0});
  if (project_out_) out = project_out_->forward(out);
  return out;
}

Tensor ResidualLFQ::codebooks() const {
  std::vector<Tensor> books;
  for (const auto& l : layers_) books.push_back(l->codebook());
  return stack(books, 0);
}

GroupedResidualLFQ::GroupedResidualLFQ(GroupedResidualLFQOptions opts, Generator& gen)
    : Grouped("GroupedResidualLFQ", {.dim = opts.rlfq.lfq.dim,
                                     .groups = opts.groups,
                                     .channel_last = !opts.rlfq.lfq.channel_first,
                                     .accept_image_fmap = true,
                                     .losses = MemberLosses::summed}) {
  const uint64_t seed = draw_seed(gen);
  for (int64_t g = 0; g < opts.groups; ++g) {
    ResidualLFQOptions o = opts.rlfq;
    o.lfq.dim = opts.rlfq.lfq.dim / opts.groups;
    o.lfq.channel_first = false;
    add_group(std::shared_ptr<ResidualLFQ>(
        new ResidualLFQ(o, detail::child_seed(seed, "group" + std::to_string(g)))));
  }
}

Tensor GroupedResidualLFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
