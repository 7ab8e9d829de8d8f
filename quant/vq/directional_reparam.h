#pragma once
// DiVeQ's directional reparameterisation (Vali et al., "DiVeQ: differentiable
// vector quantization using the reparameterization trick"): the output is the
// input moved by the quantization error's length along a noisy, constant
// direction, so the loss gradient reaches the input and the code's distance
// to it, where the straight-through estimator gives the code nothing.
#include "engine/tensor.h"

namespace quanta::quant {

/** x + sg(n) * |q - x| along the last dim, where n = l2norm((q - x) +
 * sqrt(variance) * noise) (l2norm's eps 1e-6) is held constant. `noise`
 * has x's shape (standard normal draws; undefined: none, then the value is q
 * up to rounding). Gradients reach x and q; the norm's gradient at a zero
 * error is 0. x, q: same shape, floating. */
Tensor directional_reparam(const Tensor& x, const Tensor& q, double variance, const Tensor& noise);

}  // namespace quanta::quant
