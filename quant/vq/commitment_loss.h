#pragma once
// The commitment loss as one fused op: it runs on every training step over
// every token, so its forward and backward are single passes.
#include <vector>

#include "engine/tensor.h"

namespace quanta::quant {

/** mean((q - x)^2) over the valid tokens' elements: x and q [..., D] (same
 * shape and dtype, f32 or f64, CPU), `valid` bool over the leading dims
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

/** Per-row 1/0 weights from `valid` (bool over the `rows` leading
 * positions), or empty when `valid` is undefined (all rows count). */
template <class T>
std::vector<T> row_weights(const Tensor& valid, int64_t rows);

}  // namespace quanta::quant
