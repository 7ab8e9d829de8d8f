#pragma once
// Quantizers work on tokens [B, N, D]. Users hand them channel-last sequences
// [B, N, D], single vectors [B, D], channel-first sequences [B, D, N] or image
// and video feature maps [B, D, H, W(, T)]: TokenLayout converts to tokens and
// back, and gives indices the input's spatial shape, as the reference does.
#include <string>

#include "engine/shape.h"
#include "engine/tensor.h"

namespace quanta::quant {

class TokenLayout {
 public:
  /** Reads the layout of `x`. `channel_last` = false means the feature
   * dimension is dim 1 ([B, D, N]); inputs of rank >= 4 are always feature
   * maps with channels at dim 1. `who` names the layer in errors. Throws
   * std::invalid_argument for rank < 2 or a feature size other than `dim`
   * (when `dim` > 0). */
  TokenLayout(const Tensor& x, bool channel_last, int64_t dim, const std::string& who);

  /** `x` as tokens [B, N, D] (a view when the layout allows, else a copy). */
  Tensor to_tokens(const Tensor& x) const;
  /** Tokens [B, N, C] back to the input's layout with C features
   * ([B, C], [B, N, C], [B, C, N] or [B, C, H, W...]). */
  Tensor from_tokens(const Tensor& y) const;
  /** Per-token values [B, N, extra...] (indices, masks) to the input's
   * spatial shape: [B, extra...], [B, N, extra...] or [B, H, W..., extra...]. */
  Tensor spatial_from_tokens(const Tensor& v) const;
  /** The inverse of spatial_from_tokens: [B, spatial..., extra...] to
   * [B, N, extra...] for `extra_dims` trailing dimensions. */
  Tensor spatial_to_tokens(const Tensor& v, int64_t extra_dims) const;

  int64_t batch() const { return batch_; }
  int64_t tokens() const { return tokens_; }
  int64_t features() const { return features_; }
  /** The spatial shape of the input (N for sequences, H, W... for maps,
   * empty for single vectors). */
  const Shape& spatial() const { return spatial_; }

 private:
  int64_t batch_ = 0, tokens_ = 0, features_ = 0;
  Shape spatial_;
  bool single_ = false;         // [B, D]
  bool channel_first_ = false;  // features at dim 1
};

namespace detail {

/** The mask of `layout`'s input as a bool [B, N] tensor (mask [B, N] or of the
 * input's spatial shape); undefined when `mask` is. Errors name `who`. */
Tensor token_mask(const Tensor& mask, const TokenLayout& layout, const std::string& who);

}  // namespace detail

}  // namespace quanta::quant
