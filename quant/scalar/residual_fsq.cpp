#include "quant/scalar/residual_fsq.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/ops/join.h"
#include "quant/residual_of_impl.h"
#include "quant/scalar/scalar_common.h"

namespace quanta::quant {
namespace {

[[noreturn]] void residual_fsq_fail(const std::string& what) {
  throw std::invalid_argument("[ResidualFSQ] " + what);
}

}  // namespace

StackPlan LayerTraits<FSQ>::plan(Options& opts) {
  if (opts.fsq.num_codebooks != 1) residual_fsq_fail("num_codebooks must be 1");
  const int64_t d = static_cast<int64_t>(opts.fsq.levels.size());
  if (d == 0) residual_fsq_fail("levels must not be empty");
  return {.dim = opts.fsq.dim > 0 ? opts.fsq.dim : d,
          .layer_dim = d,
          .num_quantizers = opts.num_quantizers,
          .channel_last = !opts.fsq.channel_first,
          .accept_image_fmap = true,
          .projection_bias = opts.fsq.projection_has_bias,
          .dropout = {opts.quantize_dropout, opts.quantize_dropout_cutoff_index,
                      opts.quantize_dropout_multiple_of}};
}

std::shared_ptr<FSQ> LayerTraits<FSQ>::make_layer(const Options& opts, const StackPlan& plan,
                                                  int64_t, const std::vector<std::shared_ptr<FSQ>>&,
                                                  Generator& gen) {
  FSQOptions lo = opts.fsq;
  lo.dim = plan.layer_dim;
  lo.channel_first = false;
  lo.preserve_symmetry = true;
  return std::make_shared<FSQ>(lo, gen);
}

QuantizeOutput LayerTraits<FSQ>::quantize(FSQ& layer, const Tensor& residual, const Tensor&,
                                          const QuantizeOptions&) {
  return layer.forward(residual, Tensor());  // FSQ quantizes every token alike
}

Tensor LayerTraits<FSQ>::codes(FSQ& layer, const Tensor& indices) {
  return layer.indices_to_grid_codes(indices);
}

Tensor LayerTraits<FSQ>::level_scales(const Options& opts, const StackPlan& plan) {
  std::vector<double> scales;
  for (int64_t q = 0; q < plan.num_quantizers; ++q)
    for (int64_t l : opts.fsq.levels) scales.push_back(std::pow(double(l), -double(q)));
  return from_vector<double>(scales, {plan.num_quantizers, plan.layer_dim}).to(DType::f32);
}

Tensor LayerTraits<FSQ>::input_bound(const Options& opts, const StackPlan& plan) {
  std::vector<double> bound;
  if (opts.soft_clamp_input_value)
    bound.assign(static_cast<size_t>(plan.layer_dim), *opts.soft_clamp_input_value);
  else if (opts.fsq.bound_hard_clamp)
    for (int64_t l : opts.fsq.levels) bound.push_back(1.0 + 1.0 / double(l - 1));
  if (bound.empty()) return Tensor();
  return from_vector<double>(bound, {plan.layer_dim}).to(DType::f32);
}

Tensor LayerTraits<FSQ>::bound_input(const Tensor& z, const Tensor& bound) {
  return detail::soft_clamp(z, bound.to(z.dtype()));
}

GroupedLayout LayerTraits<FSQ>::grouped_layout(const GroupedOptions& opts) {
  return {.dim = opts.rfsq.fsq.dim,
          .groups = opts.groups,
          .channel_last = !opts.rfsq.fsq.channel_first,
          .accept_image_fmap = true};
}

ResidualFSQOptions LayerTraits<FSQ>::group_options(const GroupedOptions& opts) {
  ResidualFSQOptions o = opts.rfsq;
  o.fsq.dim = opts.rfsq.fsq.dim / opts.groups;
  o.fsq.channel_first = false;
  return o;
}

template class ResidualOf<FSQ>;
template class GroupedOf<FSQ, ResidualFSQ>;

Tensor ResidualFSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

Tensor ResidualFSQ::codebooks() const {
  std::vector<Tensor> books;
  for (int64_t q = 0; q < num_quantizers(); ++q) books.push_back(layer(q).implicit_codebook());
  return stack(books, 0);
}

Tensor GroupedResidualFSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
