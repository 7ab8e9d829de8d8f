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

/** How a VQ layer's output gradient reaches its input. */
enum class GradientRoute {
  rotation,          // rotate_to
  straight_through,  // the identity (straight_through in engine/ops)
};

/** A VQ layer's training output and its MSE commitment loss as one op. */
struct TrainingOutput {
  Tensor quantized;   // q's value; its gradient reaches x along the route
  Tensor commitment;  // commitment_loss(x, q, valid)
};

/** rotate_to (or straight_through) and commitment_loss(x, q, valid) fused:
 * the same values and gradients, but backward forms x's whole gradient in
 * one pass over x, q and the output gradient, where the separate ops take
 * three passes and an add. This is the VQ training hot path. `q` receives
 * no gradient (use the separate ops for a learnable codebook). */
TrainingOutput route_with_commitment(const Tensor& x, const Tensor& q, const Tensor& valid,
                                     GradientRoute route);

}  // namespace quanta::quant
