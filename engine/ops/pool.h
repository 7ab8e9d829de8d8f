#pragma once
// 2-d pooling and nearest upsampling over the last two dims of [N, C, H, W]
// (or [C, H, W]) tensors, with PyTorch's output sizes (floor, no ceil_mode).
// Pools compute f32/f64 (bf16/f16 in f32); integer inputs are refused.
#include <array>
#include <cstdint>

#include "engine/tensor.h"

namespace quanta {

/** Mean over each kernel window; stride {0, 0} means stride = kernel.
 * Padding counts as zeros in the mean (count_include_pad, like PyTorch);
 * padding must be at most half the kernel. Returns [N, C, OH, OW] with
 * OH = (H + 2 padding - kernel) / stride + 1. */
Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel,
                  std::array<int64_t, 2> stride = {0, 0}, std::array<int64_t, 2> padding = {0, 0});

/** Maximum over each (dilated) kernel window; stride {0, 0} means stride =
 * kernel; padding is ignored (never the max) and must be at most half the
 * dilated kernel. The gradient goes to the first maximal element (NaN wins).
 * OH = (H + 2 padding - dilation (kernel - 1) - 1) / stride + 1. */
Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel,
                  std::array<int64_t, 2> stride = {0, 0}, std::array<int64_t, 2> padding = {0, 0},
                  std::array<int64_t, 2> dilation = {1, 1});

/** Nearest-neighbour 2x upsampling: [N, C, H, W] -> [N, C, 2H, 2W]; the
 * gradient sums each 2x2 block. Any plain dtype. */
Tensor interpolate_nearest2x(const Tensor& x);

}  // namespace quanta
