#pragma once
// The commitment loss as one fused op: it runs on every training step over
// every token, so its forward and backward are single passes.
#include "engine/tensor.h"

namespace quanta::quant {

/** mean((q - x)^2) over the valid tokens' elements: x and q [..., D] (same
 * shape and dtype, f32 or f64, CPU), `valid` bool over the leading dims
 * (undefined = all valid). 0 when no token is valid. Gradients reach x and,
 * when it requires grad, q (a learnable codebook). */
Tensor commitment_loss(const Tensor& x, const Tensor& q, const Tensor& valid = Tensor());

}  // namespace quanta::quant
