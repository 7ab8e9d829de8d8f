#include "quant/grouped.h"

#include <stdexcept>
#include <utility>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void grouped_fail(const std::string& who, const std::string& what) {
  std::string m = "[" + who + "] ";
  m += what;
  throw std::invalid_argument(m);
}

}  // namespace

Grouped::Grouped(std::string name, GroupedLayout layout)
    : Quantizer(std::move(name)), layout_(layout) {
  if (layout_.groups <= 0 || layout_.dim <= 0 || layout_.dim % layout_.groups != 0) {
    std::string m = "dim ";
    m += std::to_string(layout_.dim);
    m += " must be a positive multiple of groups ";
    m += std::to_string(layout_.groups);
    grouped_fail(type_name(), m);
  }
  list_ = register_module("rvqs", std::make_shared<Module>("ModuleList"));
}

void Grouped::add_group(std::shared_ptr<Quantizer> group) {
  list_->register_module(std::to_string(groups_.size()), group);
  groups_.push_back(std::move(group));
}

QuantizeOutput Grouped::forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  if (x.dim() >= 4 && !layout_.accept_image_fmap)
    grouped_fail(type_name(), std::string("got a feature map of shape ") + shape_str(x.shape()) +
                                  "; set accept_image_fmap to quantize [B, D, H, W...] inputs");
  const TokenLayout layout(x, layout_.channel_last, layout_.dim, type_name());
  const Tensor token_mask = detail::token_mask(mask, layout, type_name());
  QuantizeOptions each = opts;
  if (!each.last_kept) each.last_kept = dropout_decision();
  const std::vector<Tensor> parts = chunk(layout.to_tokens(x), groups(), -1);
  std::vector<Tensor> outs, indices, losses;
  MemberTerms terms;  // named by group 0
  for (int64_t g = 0; g < groups(); ++g) {
    const QuantizeOutput o = group(g).forward(parts[static_cast<size_t>(g)], token_mask, each);
    outs.push_back(o.quantized);
    indices.push_back(layout.spatial_from_tokens(o.indices));
    losses.push_back(o.loss);
    if (terms.empty())
      for (const auto& [name, t] : o.losses) terms.emplace_back(name, std::vector<Tensor>{});
    for (auto& [name, values] : terms) values.push_back(o.term(name));
  }
  QuantizeOutput out;
  out.quantized = layout.from_tokens(cat(outs, -1));
  out.indices = stack(indices);
  combine_member_losses(out, losses, terms, layout_.losses, zeros({}, options_of(out.quantized)));
  return out;
}

std::vector<Tensor> Grouped::per_group(const Tensor& indices, bool output) {
  if (indices.dim() < 2 || indices.size(0) != groups())
    grouped_fail(type_name(), std::string("expects indices [groups = ") + std::to_string(groups()) +
                                  ", ..., q], got " + shape_str(indices.shape()));
  std::vector<Tensor> out;
  for (int64_t g = 0; g < groups(); ++g) {
    const Tensor idx = select(indices, 0, g);
    out.push_back(output ? group(g).get_output_from_indices(idx)
                         : group(g).get_codes_from_indices(idx));
  }
  return out;
}

Tensor Grouped::get_codes_from_indices(const Tensor& indices) {
  return stack(per_group(indices, false));
}

Tensor Grouped::get_output_from_indices(const Tensor& indices) {
  return cat(per_group(indices, true), -1);
}

}  // namespace quanta::quant
