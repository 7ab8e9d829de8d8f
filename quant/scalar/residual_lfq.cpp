#include "quant/scalar/residual_lfq.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/ops/join.h"
#include "quant/residual_of_impl.h"

namespace quanta::quant {
namespace {

[[noreturn]] void residual_lfq_fail(const std::string& what) {
  throw std::invalid_argument("[ResidualLFQ] " + what);
}

}  // namespace

StackPlan LayerTraits<LFQ>::plan(Options& opts) {
  if (opts.lfq.num_codebooks != 1) residual_lfq_fail("num_codebooks must be 1");
  // The layer geometry, from one probe layer without projections (its
  // random state is thrown away).
  LFQOptions probe = opts.lfq;
  probe.has_projections = false;
  probe.dim = 0;
  if (probe.codebook_size == 0) {
    if (opts.lfq.dim <= 0) residual_lfq_fail("give dim or codebook_size");
    probe.dim = opts.lfq.dim;
  }
  Generator scratch(0);
  const int64_t d = LFQ(probe, scratch).codebook_dim();
  return {.dim = opts.lfq.dim > 0 ? opts.lfq.dim : d,
          .layer_dim = d,
          .num_quantizers = opts.num_quantizers,
          .channel_last = !opts.lfq.channel_first,
          .accept_image_fmap = true,
          .projection_bias = opts.lfq.projection_has_bias,
          .dropout = {opts.quantize_dropout, opts.quantize_dropout_cutoff_index,
                      opts.quantize_dropout_multiple_of}};
}

std::shared_ptr<LFQ> LayerTraits<LFQ>::make_layer(const Options& opts, const StackPlan& plan,
                                                  int64_t i,
                                                  const std::vector<std::shared_ptr<LFQ>>&,
                                                  Generator& gen) {
  LFQOptions lo = opts.lfq;
  lo.dim = plan.layer_dim;
  lo.codebook_size = int64_t{1} << plan.layer_dim;
  lo.has_projections = false;
  lo.channel_first = false;
  lo.codebook_scale = opts.lfq.codebook_scale * std::ldexp(1.0, -int(i));
  lo.soft_clamp_input_value = opts.lfq.soft_clamp_input_value * std::ldexp(1.0, -int(i));
  return std::make_shared<LFQ>(lo, gen);
}

QuantizeOutput LayerTraits<LFQ>::quantize(LFQ& layer, const Tensor& residual,
                                          const Tensor& token_mask, const QuantizeOptions& opts) {
  return layer.forward(residual, token_mask, opts.inv_temperature);
}

Tensor LayerTraits<LFQ>::codes(LFQ& layer, const Tensor& indices) {
  return layer.indices_to_grid_codes(indices);
}

GroupedLayout LayerTraits<LFQ>::grouped_layout(const GroupedOptions& opts) {
  return {.dim = opts.rlfq.lfq.dim,
          .groups = opts.groups,
          .channel_last = !opts.rlfq.lfq.channel_first,
          .accept_image_fmap = true};
}

ResidualLFQOptions LayerTraits<LFQ>::group_options(const GroupedOptions& opts) {
  ResidualLFQOptions o = opts.rlfq;
  o.lfq.dim = opts.rlfq.lfq.dim / opts.groups;
  o.lfq.channel_first = false;
  return o;
}

template class ResidualOf<LFQ>;
template class GroupedOf<LFQ, ResidualLFQ>;

void ResidualLFQ::set_token_mean(const TokenMean& fn) {
  for (int64_t q = 0; q < num_quantizers(); ++q) layer(q).token_mean = fn;
}

Tensor ResidualLFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

Tensor ResidualLFQ::codebooks() const {
  std::vector<Tensor> books;
  for (int64_t q = 0; q < num_quantizers(); ++q) books.push_back(layer(q).codebook());
  return stack(books, 0);
}

Tensor GroupedResidualLFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
