#pragma once
// The commitment loss as one fused op: it runs on every training step over
// every token, so its forward and backward are single passes.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta::quant {

/** mean((q - x)^2) over the valid tokens' elements: x and q [..., D] (same
 * shape and dtype, f32 or f64, one device with the kernels of
 * quant/kernels/table.h), `valid` bool over the leading dims
 * (undefined = all valid). 0 when no token is valid. Gradients reach x and,
 * when it requires grad, q (a learnable codebook). */
Tensor commitment_loss(const Tensor& x, const Tensor& q, const Tensor& valid = Tensor());

/** The forward of commitment_loss, shared with the fused training output
 * (rotation_trick.h), on x's device (never read by the host): `sums`, f64
 * [2], holds the sum of (q - x)^2 over the valid tokens' elements and the
 * number of those elements. Same requirements as commitment_loss; no graph. */
struct SquaredError {
  Tensor sums;
  /** sums[0] / sums[1] (0 when no element counts), a 0-d tensor of `dtype`. */
  Tensor mean(DType dtype) const;
  /** scale * g / sums[1] as one f64 on the device (g a 0-d gradient): the
   * backward's coefficient of (x - q); any value when no element counts,
   * since then no row takes it. */
  Tensor coefficient(const Tensor& g, double scale) const;
};
SquaredError masked_squared_error(const Tensor& x, const Tensor& q, const Tensor& valid);

/** The row mask of `valid` (bool over the `rows` leading positions) as a
 * contiguous u8 tensor on valid's device, for the kernels' `valid` pointer;
 * undefined when `valid` is (all rows count). Throws
 * "[commitment_loss] valid has N entries for R tokens" on a size mismatch. */
Tensor row_mask(const Tensor& valid, int64_t rows);

}  // namespace quanta::quant
