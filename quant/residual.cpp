#include "quant/residual.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "engine/precision.h"

namespace quanta::quant {

QuantizeOutput quantize_tokens(const TokenLayout& layout, const Tensor& x, Module* project_in,
                               Module* project_out,
                               const std::function<QuantizeOutput(const Tensor&)>& quantize,
                               const MaskedOutput& masked) {
  const Tensor input = layout.to_tokens(x);
  QuantizeOutput out = quantize(project_in ? project_in->forward(input) : input);
  if (project_out) out.quantized = project_out->forward(out.quantized);
  if (masked.keep.defined()) {
    const Tensor keep = unsqueeze(masked.keep, -1);
    out.quantized = masked.zeros ? out.quantized * to_dtype(keep, out.quantized.dtype())
                                 : where(keep, out.quantized, input);
  }
  out.quantized = layout.from_tokens(out.quantized);
  out.indices = layout.spatial_from_tokens(out.indices);
  return out;
}

void combine_member_losses(QuantizeOutput& out, const std::vector<Tensor>& losses,
                           const MemberTerms& terms, MemberLosses how, const Tensor& zero) {
  if (how == MemberLosses::none) {
    out.loss = zero;
    return;
  }
  out.loss = stack(losses);
  for (const auto& [name, values] : terms) {
    Tensor t;
    if (how == MemberLosses::stacked) {
      t = stack(values);
    } else {
      for (const Tensor& v : values) t = t.defined() ? t + v : v;
    }
    out.losses.emplace_back(name, t);
  }
}

Tensor frac_gradient(const Tensor& q, double grad_frac) {
  const Tensor cut = q.detach();
  return grad_frac <= 0 ? cut : q * grad_frac + cut * (1 - grad_frac);
}

QuantizeOutput residual_quantize(const Tensor& tokens, int64_t num_layers, int64_t last_kept,
                                 DType index_dtype, MemberLosses losses, const ResidualLayer& layer,
                                 double grad_frac) {
  const int64_t b = tokens.size(0), n = tokens.size(1);
  const Tensor zero_loss = zeros({}, options_of(tokens));
  Tensor residual = tokens;
  std::vector<Tensor> outputs, indices, layer_losses;  // outputs summed once (add_n)
  MemberTerms terms;  // named by the first layer; dropped layers count 0 when stacked
  for (int64_t i = 0; i < num_layers; ++i) {
    if (last_kept >= 0 && i > last_kept) {
      indices.push_back(full({b, n}, -1.0, {.dtype = index_dtype, .device = tokens.device()}));
      layer_losses.push_back(zero_loss);
      if (losses == MemberLosses::stacked)
        for (auto& [name, values] : terms) values.push_back(zero_loss);
      continue;
    }
    const QuantizeOutput o = layer(i, residual, outputs);
    // Later layers see a residual cut from the graph (reference issue #33),
    // unless a fraction of their gradient is asked to reach this layer.
    residual = residual - frac_gradient(o.quantized, grad_frac);
    outputs.push_back(o.quantized);
    indices.push_back(o.indices.dtype() == index_dtype ? o.indices : o.indices.to(index_dtype));
    layer_losses.push_back(o.loss);
    if (terms.empty())
      for (const auto& [name, t] : o.losses)
        terms.emplace_back(name, std::vector<Tensor>(static_cast<size_t>(i), zero_loss));
    for (auto& [name, values] : terms) values.push_back(o.term(name));
  }
  QuantizeOutput out;
  out.quantized = add_n(outputs);
  out.indices = stack(indices, -1);
  combine_member_losses(out, layer_losses, terms, losses, zero_loss);
  return out;
}

Tensor residual_codes(const Tensor& indices, int64_t num_layers, const ResidualLookup& lookup,
                      const char* who) {
  if (indices.dim() < 1 || indices.size(-1) > num_layers) {
    std::string m = std::string("[") + who + "] get_codes_from_indices expects indices [..., q]";
    m += " with q <= ";
    m += std::to_string(num_layers);
    m += ", got ";
    m += shape_str(indices.shape());
    throw std::invalid_argument(m);
  }
  const Shape lead(indices.shape().begin(), indices.shape().end() - 1);
  const TensorOptions on{.dtype = DType::i64, .device = indices.device()};
  const Tensor none = zeros({}, on);
  std::vector<Tensor> codes;
  for (int64_t i = 0; i < num_layers; ++i) {
    // Missing layers are dropped ones; dropped indices look up code 0, zeroed after.
    const Tensor idx =
        i < indices.size(-1) ? to_dtype(select(indices, -1, i), DType::i64) : full(lead, -1.0, on);
    const Tensor dropped = lt(idx, none);
    const Tensor c = lookup(i, where(dropped, none, idx), codes);
    codes.push_back(masked_fill(c, unsqueeze(dropped, -1), 0.0));
  }
  return stack(codes);
}

Residual::Residual(std::string name, QuantizeDropout dropout)
    : Quantizer(std::move(name)), dropout_(dropout) {}

QuantizeOutput Residual::forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  return forward_kept(x, mask, opts.last_kept ? *opts.last_kept : dropout_decision(), opts);
}

int64_t Residual::dropout_decision() {
  return dropout_.applies(is_training(), num_quantizers()) ? draw_dropout() : kKeepAllLayers;
}

int64_t Residual::draw_dropout() { return dropout_.draw(dropout_stream_.next(), num_quantizers()); }

}  // namespace quanta::quant
