#include "quant/token_layout.h"

#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/ops/view.h"

namespace quanta::quant {

TokenLayout::TokenLayout(const Tensor& x, bool channel_last, int64_t dim, const std::string& who) {
  const Shape& s = x.shape();
  if (s.size() < 2)
    throw std::invalid_argument("[" + who +
                                "] expects [B, D], [B, N, D], [B, D, N] or [B, D, H, W...]"
                                " input, got shape " +
                                shape_str(s));
  single_ = s.size() == 2;
  channel_first_ = !single_ && (s.size() >= 4 || !channel_last);
  batch_ = s[0];
  features_ = single_ ? s[1] : (channel_first_ ? s[1] : s.back());
  if (single_) {
    tokens_ = 1;
  } else if (channel_first_) {
    spatial_.assign(s.begin() + 2, s.end());
  } else {
    spatial_.assign(s.begin() + 1, s.end() - 1);
  }
  if (!single_)
    tokens_ =
        std::accumulate(spatial_.begin(), spatial_.end(), int64_t{1}, std::multiplies<int64_t>());
  if (dim > 0 && features_ != dim)
    throw std::invalid_argument("[" + who + "] expects " + std::to_string(dim) +
                                " features per token, got input of shape " + shape_str(s) +
                                (channel_first_ ? " (features at dim 1)" : " (features last)"));
}

Tensor TokenLayout::to_tokens(const Tensor& x) const {
  if (single_) return unsqueeze(x, 1);
  if (!channel_first_) return reshape(x, {batch_, tokens_, features_});
  // [B, D, spatial...] -> [B, D, N] -> [B, N, D]
  return transpose(reshape(x, {batch_, features_, tokens_}), 1, 2);
}

Tensor TokenLayout::from_tokens(const Tensor& y) const {
  const int64_t c = y.shape().back();
  if (single_) return reshape(y, {batch_, c});
  Shape out{batch_};
  if (!channel_first_) {
    out.insert(out.end(), spatial_.begin(), spatial_.end());
    out.push_back(c);
    return reshape(y, out);
  }
  out.push_back(c);
  out.insert(out.end(), spatial_.begin(), spatial_.end());
  return reshape(transpose(y, 1, 2), out);
}

Tensor TokenLayout::spatial_from_tokens(const Tensor& v) const {
  const Shape& s = v.shape();
  Shape out{batch_};
  if (!single_) out.insert(out.end(), spatial_.begin(), spatial_.end());
  out.insert(out.end(), s.begin() + 2, s.end());
  return reshape(v, out);
}

Tensor TokenLayout::spatial_to_tokens(const Tensor& v, int64_t extra_dims) const {
  const Shape& s = v.shape();
  Shape out{batch_, tokens_};
  out.insert(out.end(), s.end() - extra_dims, s.end());
  return reshape(v, out);
}

Tensor detail::token_mask(const Tensor& mask, const TokenLayout& layout, const std::string& who) {
  if (!mask.defined()) return mask;
  if (mask.dtype() != DType::boolean)
    throw std::invalid_argument("[" + who + "] mask must be bool, got " + dtype_name(mask.dtype()));
  if (mask.numel() != layout.batch() * layout.tokens())
    throw std::invalid_argument("[" + who + "] mask of shape " + shape_str(mask.shape()) +
                                " does not cover " + std::to_string(layout.batch()) + " x " +
                                std::to_string(layout.tokens()) + " tokens");
  return reshape(mask, {layout.batch(), layout.tokens()});
}

}  // namespace quanta::quant
