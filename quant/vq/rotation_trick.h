#pragma once
// Gradient estimators that carry the loss gradient past the (non-
// differentiable) nearest-code choice to the encoder output.
#include "engine/tensor.h"

namespace quanta::quant {

/** The rotation trick (Fifty et al., ICLR 2025) on rows along the last dim:
 * the value is `q` exactly, the gradient to `x` is lambda R^T g with
 * u = x/|x|, q^ = q/|q|, w = (u + q^)/|u + q^|, lambda = |q|/|x| (norms clamped
 * at 1e-6 as the reference does) and R = I - 2 w w^T + 2 q^ u^T, all treated as
 * constants. `q` receives no gradient. x and q: same shape, f32 or f64, CPU. */
Tensor rotate_to(const Tensor& x, const Tensor& q);

}  // namespace quanta::quant
