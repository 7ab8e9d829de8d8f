#pragma once
// Adaptive average pooling and linear interpolation (align_corners=False) of
// the spatial dims of [B, C, s...] tensors, PyTorch's rules. Both are
// separable linear maps: each dim is one small constant matrix [out, in],
// built on the host and applied with matmul, so gradients, dtypes and devices
// are matmul's and no kernel of their own is needed.
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "engine/tensor.h"

namespace quanta::quant {

/** The resampling matrices a layer applies, kept on their device: a layer
 * that resamples the same shapes every forward builds and uploads each one
 * once instead of every forward. Owned by the layer, so the device tensors
 * go with it (a process-wide cache would outlive the device context at
 * exit). Not thread-safe, as a layer's forward is not. */
class ResampleMatrices {
 public:
  /** The [in, out] matrix (transposed, ready to multiply a last dim of size
   * `in` from the right) that `matrix_of` builds, in `dtype` on `device`. */
  Tensor get(std::vector<double> (*matrix_of)(int64_t, int64_t), int64_t in, int64_t out,
             DType dtype, const Device& device);
  /** Matrices held (for tests). */
  std::size_t size() const { return held_.size(); }

 private:
  using Key =
      std::tuple<std::vector<double> (*)(int64_t, int64_t), int64_t, int64_t, DType, std::string>;
  std::map<Key, Tensor> held_;
};

/** The [out, in] row-major matrix of adaptive average pooling along one dim:
 * row i averages the window [floor(i*in/out), ceil((i+1)*in/out)). */
std::vector<double> adaptive_avg_pool_matrix(int64_t in, int64_t out);

/** The [out, in] row-major matrix of linear interpolation along one dim with
 * align_corners=False: row i samples src = max((i + 0.5) * in/out - 0.5, 0). */
std::vector<double> interpolate_linear_matrix(int64_t in, int64_t out);

/** x [B, C, s_1..s_k] pooled to [B, C, out_1..out_k] (adaptive_avg_pool{k}d);
 * the matrices come from `held` when given (else are built for this call). */
Tensor adaptive_avg_pool_nd(const Tensor& x, const std::vector<int64_t>& out,
                            ResampleMatrices* held = nullptr);

/** x [B, C, s_1..s_k] resized to [B, C, out_1..out_k] by linear / bilinear /
 * trilinear interpolation, align_corners=False (F.interpolate); the matrices
 * come from `held` when given. */
Tensor interpolate_linear_nd(const Tensor& x, const std::vector<int64_t>& out,
                             ResampleMatrices* held = nullptr);

}  // namespace quanta::quant
