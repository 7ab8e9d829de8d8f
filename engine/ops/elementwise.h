#pragma once
// Elementwise ops with NumPy broadcasting. Floating results for transcendental
// functions (integer inputs compute in f32); 16-bit floats compute in f32 on
// the CPU and are stored back. (nd) marks ops without a gradient.
#include <vector>

#include "engine/tensor.h"

namespace quanta {

// ---- binary arithmetic (broadcasting, type promotion) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
/** a ** b elementwise. */
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
/** terms[0] + terms[1] + ... (left to right, so the same values as the
 * chain of add()s), in one pass over the inputs when they share shape,
 * dtype (f32 or f64) and the CPU; otherwise the chain itself (broadcasting
 * and promotion as add). Each input's gradient is the output's. Needs at
 * least one term. */
Tensor add_n(const std::vector<Tensor>& terms);

/** Elementwise larger / smaller (ties split the gradient evenly). */
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
/** relu's backward in one pass: grad where x > 0, else 0 (broadcasting as
 * add); the same values as where(gt(x, 0), grad, 0). Differentiable in grad. */
Tensor relu_backward(const Tensor& grad, const Tensor& x);

// ---- unary ----
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor log1p(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor tanh(const Tensor& x);
/** The error function, 2/sqrt(pi) * integral of exp(-t^2) from 0 to x. */
Tensor erf(const Tensor& x);
/** The inverse of erf on [-1, 1] (+-inf at +-1, NaN outside). */
Tensor erfinv(const Tensor& x);
Tensor atan(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01);
enum class GeluApprox { none, tanh };
/** GELU, exact (erf) or the tanh approximation. */
Tensor gelu(const Tensor& x, GeluApprox approx = GeluApprox::none);
Tensor silu(const Tensor& x);
/** log(1 + exp(beta x)) / beta, linear above `threshold` like PyTorch. */
Tensor softplus(const Tensor& x, double beta = 1.0, double threshold = 20.0);
Tensor square(const Tensor& x);
/** Clamp to [lo, hi]; pass NaN to leave a side open. */
Tensor clamp(const Tensor& x, double lo, double hi);
/** Clamp with tensor bounds (broadcasting); undefined bound = open side. */
Tensor clamp(const Tensor& x, const Tensor& lo, const Tensor& hi);
/** cond ? a : b, broadcasting all three. */
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// ---- (nd) ----
Tensor sign(const Tensor& x);
Tensor round(const Tensor& x);  // half to even, like torch.round
Tensor floor(const Tensor& x);
Tensor ceil(const Tensor& x);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_xor(const Tensor& a, const Tensor& b);
Tensor logical_not(const Tensor& x);
Tensor isnan(const Tensor& x);
Tensor isfinite(const Tensor& x);

// ---- straight-through and in-place helpers ----
/** x + (q - x).detach(): value of q, gradient of identity to x. */
Tensor straight_through(const Tensor& x, const Tensor& q);

/** In place, for optimisers and accumulators: refuse tensors that require
 * grad while grad mode is on. `src` broadcasts to `dst`. */
void add_(const Tensor& dst, const Tensor& src, double alpha = 1.0);
void mul_(const Tensor& dst, const Tensor& src);
void mul_(const Tensor& dst, double value);
/** dst /= src, element by element (the same rounding as div). */
void div_(const Tensor& dst, const Tensor& src);
void copy_(const Tensor& dst, const Tensor& src);
void fill_(const Tensor& dst, double value);
/** dst = dst + alpha * a * b. */
void addcmul_(const Tensor& dst, const Tensor& a, const Tensor& b, double alpha);
/** dst = dst + alpha * a / b. */
void addcdiv_(const Tensor& dst, const Tensor& a, const Tensor& b, double alpha);

// ---- operators ----
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

/** A 0-d tensor holding `v` in the dtype `x` computes with a scalar. */
Tensor scalar_like(const Tensor& x, double v);
/** scalar_like(x, v) as a shared constant (shared_full): what an op takes
 * as an operand and never writes, made on a device once instead of by a
 * fill at every call. The operators with a double above use it. */
Tensor constant_like(const Tensor& x, double v);

}  // namespace quanta
