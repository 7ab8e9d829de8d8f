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
 * (rotation_trick.h): sum of (q - x)^2 over the valid tokens' elements, and
 * the number of those elements. Same requirements as commitment_loss; no
 * graph. */
struct SquaredError {
  double total = 0;
  double elements = 0;
};
SquaredError masked_squared_error(const Tensor& x, const Tensor& q, const Tensor& valid);

/** The row mask of `valid` (bool over the `rows` leading positions) as a
 * contiguous u8 tensor on valid's device, for the kernels' `valid` pointer;
 * undefined when `valid` is (all rows count). Throws
 * "[commitment_loss] valid has N entries for R tokens" on a size mismatch. */
Tensor row_mask(const Tensor& valid, int64_t rows);

}  // namespace quanta::quant
