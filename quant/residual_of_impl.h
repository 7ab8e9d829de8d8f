#pragma once
// ResidualOf<Layer>'s member functions. Included by the one file that
// instantiates a family's stack (`template class ResidualOf<Layer>;`).
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/residual_of.h"
#include "quant/streams.h"
#include "quant/token_layout.h"

namespace quanta::quant {

template <class Layer>
typename ResidualOf<Layer>::Planned ResidualOf<Layer>::planned(Options opts) {
  const StackPlan plan = Traits::plan(opts);
  const std::string who = Traits::name;
  if (plan.num_quantizers < 1)
    throw std::invalid_argument("[" + who + "] num_quantizers must be >= 1, got " +
                                std::to_string(plan.num_quantizers));
  plan.dropout.check(who, plan.num_quantizers);
  return {std::move(opts), plan};
}

template <class Layer>
ResidualOf<Layer>::ResidualOf(Options opts, Generator& gen)
    : ResidualOf(planned(std::move(opts)), gen) {}

template <class Layer>
ResidualOf<Layer>::ResidualOf(Planned p, Generator& gen)
    : Residual(Traits::name, p.plan.dropout), opts_(std::move(p.opts)), plan_(p.plan) {
  if (plan_.layer_dim != plan_.dim) {
    project_in_ = register_module(
        "project_in",
        std::make_shared<Linear>(plan_.dim, plan_.layer_dim, gen, plan_.projection_bias));
    project_out_ = register_module(
        "project_out",
        std::make_shared<Linear>(plan_.layer_dim, plan_.dim, gen, plan_.projection_bias));
  }
  auto list = register_module("layers", std::make_shared<Module>("ModuleList"));
  for (int64_t i = 0; i < plan_.num_quantizers; ++i)
    layers_.push_back(list->register_module(std::to_string(i),
                                            Traits::make_layer(opts_, plan_, i, layers_, gen)));
  if constexpr (requires { Traits::level_scales(opts_, plan_); })
    scales_ = register_buffer("scales", Traits::level_scales(opts_, plan_), false);
  // A buffer (not saved) so that moving the stack to a device moves it too.
  if constexpr (requires { Traits::input_bound(opts_, plan_); }) {
    const Tensor bound = Traits::input_bound(opts_, plan_);
    if (bound.defined()) input_bound_ = register_buffer("input_bound", bound, false);
  }
  // "rvq.dropout": the name the VQ family's stream always had.
  seed_dropout(Generator::named(draw_seed(gen), "rvq.dropout"));
}

template <class Layer>
int64_t ResidualOf<Layer>::codebook_size() const {
  int64_t largest = 0;
  for (const auto& l : layers_) largest = std::max(largest, l->codebook_size());
  return largest;
}

template <class Layer>
bool ResidualOf<Layer>::conditions_layers() const {
  if constexpr (requires { Traits::conditions_layers(opts_); })
    return Traits::conditions_layers(opts_);
  return false;
}

template <class Layer>
Tensor ResidualOf<Layer>::level_scale(int64_t q) const {
  return scales_.defined() ? select(scales_, 0, q) : Tensor();
}

template <class Layer>
QuantizeOutput ResidualOf<Layer>::forward_kept(const Tensor& x, const Tensor& mask,
                                               int64_t last_kept, const QuantizeOptions& opts) {
  const std::string who = Traits::name;
  if (x.dim() >= 4 && !plan_.accept_image_fmap)
    throw std::invalid_argument("[" + who + "] got a feature map of shape " + shape_str(x.shape()) +
                                "; set accept_image_fmap to quantize [B, D, H, W...] inputs");
  const TokenLayout layout(x, plan_.channel_last, plan_.dim, who);
  const Tensor keep = detail::token_mask(mask, layout, who);
  double grad_frac = 0;
  if constexpr (requires { Traits::quant_grad_frac(opts_); })
    grad_frac = Traits::quant_grad_frac(opts_);
  MaskedOutput masked;
  if constexpr (requires { Traits::masked_output(opts_, keep); })
    masked = Traits::masked_output(opts_, keep);
  const bool conditioned = conditions_layers();
  const auto quantize_layer = [&](int64_t q, const Tensor& residual,
                                  const std::vector<Tensor>& earlier) {
    Layer& layer = *layers_[static_cast<size_t>(q)];
    QuantizeOptions layer_opts = opts;
    if (conditioned && !earlier.empty()) layer_opts.condition = add_n(earlier);
    if (!scales_.defined()) return Traits::quantize(layer, residual, keep, layer_opts);
    const Tensor scale = level_scale(q).to(residual.dtype());
    QuantizeOutput o = Traits::quantize(layer, residual / scale, keep, layer_opts);
    o.quantized = o.quantized * scale;
    return o;
  };
  return quantize_tokens(
      layout, x, project_in_.get(), project_out_.get(),
      [&](Tensor z) {
        if constexpr (requires { Traits::bound_input(z, input_bound_); })
          if (input_bound_.defined()) z = Traits::bound_input(z, input_bound_);
        std::optional<QuantizeOutput> searched;
        if constexpr (requires { Traits::search(opts_, true, layers_, z, keep, last_kept); })
          searched = Traits::search(opts_, is_training(), layers_, z, keep, last_kept);
        QuantizeOutput out =
            searched ? std::move(*searched)
                     : residual_quantize(z, num_quantizers(), last_kept, Traits::index_dtype,
                                         Traits::losses, quantize_layer, grad_frac);
        if constexpr (requires { Traits::after_forward(opts_, true, layers_); })
          Traits::after_forward(opts_, is_training(), layers_);
        if constexpr (requires { Traits::route_output(opts_, true, layers_, z, out); })
          Traits::route_output(opts_, is_training(), layers_, z, out);
        return out;
      },
      masked);
}

template <class Layer>
Tensor ResidualOf<Layer>::get_codes_from_indices(const Tensor& indices) {
  const bool conditioned = conditions_layers();
  return residual_codes(
      indices, num_quantizers(),
      [&](int64_t q, const Tensor& idx, const std::vector<Tensor>& earlier) {
        Layer& layer = *layers_[static_cast<size_t>(q)];
        Tensor codes;
        if constexpr (requires { Traits::codes(layer, idx, Tensor()); })
          if (conditioned && !earlier.empty()) codes = Traits::codes(layer, idx, add_n(earlier));
        if (!codes.defined()) codes = Traits::codes(layer, idx);
        return scales_.defined() ? codes * level_scale(q) : codes;
      },
      Traits::name);
}

template <class Layer>
Tensor ResidualOf<Layer>::get_output_from_indices(const Tensor& indices) {
  const Tensor summed = sum(get_codes_from_indices(indices), {0});
  return project_out_ ? project_out_->forward(summed) : summed;
}

}  // namespace quanta::quant
