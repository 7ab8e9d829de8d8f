#pragma once
// Adaptive average pooling and linear interpolation (align_corners=False) of
// the spatial dims of [B, C, s...] tensors, PyTorch's rules. Both are
// separable linear maps: each dim is one small constant matrix [out, in],
// built on the host and applied with matmul, so gradients, dtypes and devices
// are matmul's and no kernel of their own is needed.
#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace quanta::quant {

/** The [out, in] row-major matrix of adaptive average pooling along one dim:
 * row i averages the window [floor(i*in/out), ceil((i+1)*in/out)). */
std::vector<double> adaptive_avg_pool_matrix(int64_t in, int64_t out);

/** The [out, in] row-major matrix of linear interpolation along one dim with
 * align_corners=False: row i samples src = max((i + 0.5) * in/out - 0.5, 0). */
std::vector<double> interpolate_linear_matrix(int64_t in, int64_t out);

/** x [B, C, s_1..s_k] pooled to [B, C, out_1..out_k] (adaptive_avg_pool{k}d). */
Tensor adaptive_avg_pool_nd(const Tensor& x, const std::vector<int64_t>& out);

/** x [B, C, s_1..s_k] resized to [B, C, out_1..out_k] by linear / bilinear /
 * trilinear interpolation, align_corners=False (F.interpolate). */
Tensor interpolate_linear_nd(const Tensor& x, const std::vector<int64_t>& out);

}  // namespace quanta::quant
