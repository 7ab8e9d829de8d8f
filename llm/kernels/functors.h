#pragma once
// The language-model kernels' per-element math, written once for g++ and
// nvcc: the CPU entries (llm/cpu/) and the CUDA entries (llm/cuda/) call the
// same functions, so the CPU tests cover the math the GPU runs. T is the data
// type (float, double or a 16-bit float of either compiler), A the
// accumulation type (double for double, else float).
#include <cmath>
#include <cstdint>

#include "engine/kernels/functors.h"  // QUANTA_HD

namespace quanta::llm::fn {

/** v rounded to T and widened back: the rounding a tensor of dtype T adds
 * between two operations (none when T is A). */
template <class T, class A>
QUANTA_HD inline A rounded(A v) {
  return static_cast<A>(static_cast<T>(v));
}

/** RMSNorm's scale from a row's sum of squares: 1 / sqrt(mean + eps). */
template <class A>
QUANTA_HD inline A rms_scale(A sum_sq, int64_t n, A eps) {
  return A(1) / std::sqrt(sum_sq / static_cast<A>(n) + eps);
}

/** RMSNorm's output: weight times the normalised value in T, as
 * transformers' `weight * hidden.to(input_dtype)` rounds it. */
template <class T, class A>
QUANTA_HD inline T rms_out(T x, T w, A r) {
  return static_cast<T>(rounded<T>(static_cast<A>(x) * r) * static_cast<A>(w));
}

/** RMSNorm's input gradient: r g - x r^3 c, with g = gy * weight and c the
 * row's mean of g x. */
template <class A>
QUANTA_HD inline A rms_grad_x(A x, A g, A r, A c) {
  return r * g - x * r * r * r * c;
}

/** One rotated pair (a, b) = (x[d], x[d + dim/2]) by the angle whose cosine
 * and sine are c, s: (a c - b s, b c + a s), with cos and sin first rounded to
 * T and each product and sum rounded to T, as transformers' `q * cos +
 * rotate_half(q) * sin` in dtype T rounds them. */
template <class T, class A>
QUANTA_HD inline void rope_pair(T a, T b, A c, A s, T* out_a, T* out_b) {
  c = rounded<T>(c);
  s = rounded<T>(s);
  const A fa = static_cast<A>(a), fb = static_cast<A>(b);
  *out_a = static_cast<T>(rounded<T>(fa * c) - rounded<T>(fb * s));
  *out_b = static_cast<T>(rounded<T>(fb * c) + rounded<T>(fa * s));
}

/** silu(x) = x / (1 + e) from gate x and e = exp(-x), rounded to T as
 * transformers' act_fn(gate) tensor is. Below about -88 (f32) e is inf and
 * silu -0, its limit. */
template <class T, class A>
QUANTA_HD inline A swiglu_silu(A x, A e) {
  return rounded<T>(x / (A(1) + e));
}

/** SwiGLU's output: silu(x) as above, times up u. */
template <class T, class A>
QUANTA_HD inline T swiglu_out(A x, A e, A u) {
  return static_cast<T>(swiglu_silu<T>(x, e) * u);
}

/** SwiGLU's gradients for output gradient g, from x, e = exp(-x) and u as
 * above: d_up = g silu(x), and d_gate = (g u) s (1 + x (1 - s)) with s = 1 /
 * (1 + e), where g u is rounded to T (mul's gradient, a tensor of dtype T)
 * and the rest is formed in A and rounded once, as PyTorch's silu_backward
 * forms it. */
template <class T, class A>
QUANTA_HD inline T swiglu_grad_up(A x, A e, A g) {
  return static_cast<T>(g * swiglu_silu<T>(x, e));
}
template <class T, class A>
QUANTA_HD inline T swiglu_grad_gate(A x, A e, A u, A g) {
  const A s = A(1) / (A(1) + e);
  return static_cast<T>(rounded<T>(g * u) * (s * (A(1) + x * (A(1) - s))));
}

/** The last key query i may see under a causal mask, with the queries the
 * last q_len of kv_len positions (-1 and below: none). */
QUANTA_HD inline int64_t last_visible_key(int64_t i, int64_t q_len, int64_t kv_len) {
  return i + kv_len - q_len;
}

/** The first query that sees key j under a causal mask (may be >= q_len). */
QUANTA_HD inline int64_t first_seeing_query(int64_t j, int64_t q_len, int64_t kv_len) {
  const int64_t i = j - (kv_len - q_len);
  return i > 0 ? i : 0;
}

/** A probability recomputed from a score and its row's log-sum-exp (0 for a
 * row that sees no key, whose lse is -inf). */
template <class A>
QUANTA_HD inline A attention_prob(A score, A lse) {
  return lse == -INFINITY ? A(0) : std::exp(score - lse);
}

/** The score gradient of one probability: p (dp - delta), with dp = dO.v and
 * delta the row's dO.O. */
template <class A>
QUANTA_HD inline A attention_score_grad(A p, A dp, A delta) {
  return p * (dp - delta);
}

/** The causal-LM loss of one row from its max m, its sum s of exp(x - m)
 * and its target's logit: logsumexp - x[target]. */
template <class A>
QUANTA_HD inline A lm_row_loss(A m, A s, A target_logit) {
  return m + std::log(s) - target_logit;
}

/** The loss's gradient at one logit from e = exp(x - m) and 1 / s:
 * softmax's value, less 1 at the target. */
template <class A>
QUANTA_HD inline A lm_logit_grad(A e, A inv_sum, bool is_target) {
  return e * inv_sum - (is_target ? A(1) : A(0));
}

}  // namespace quanta::llm::fn
