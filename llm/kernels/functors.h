#pragma once
// The language-model kernels' per-element math, written once for g++ and
// nvcc: the CPU entries (llm/cpu/) and the CUDA entries (llm/cuda/) call the
// same functions, so the CPU tests cover the math the GPU runs. T is the data
// type (float, double or a 16-bit float of either compiler), A the
// accumulation type (double for double, else float).
#include <cmath>
#include <cstdint>

#include "engine/kernels/functors.h"  // QUANTA_HD
#include "llm/kernels/gated_act.h"
#include "llm/kernels/rms_weight.h"

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

/** The factor RMSNorm's weight stands for, in A: 1 + weight for Gemma
 * (whose norms store the offset from 1), else the weight itself. */
template <class T, class A>
QUANTA_HD inline A rms_factor(T w, RmsWeight how) {
  return how == RmsWeight::one_plus ? A(1) + static_cast<A>(w) : static_cast<A>(w);
}

/** RMSNorm's output. Llama: weight times the normalised value rounded to T,
 * as transformers' `weight * hidden.to(input_dtype)` rounds it. Gemma and
 * OLMo 2: the factor times the normalised value in A, rounded once, as
 * GemmaRMSNorm's `(x * (1 + w.float())).type_as(x)` and Olmo2RMSNorm's
 * `(w * x).to(input_dtype)`. */
template <class T, class A>
QUANTA_HD inline T rms_out(T x, T w, A r, RmsWeight how) {
  if (how != RmsWeight::rounded_first)
    return static_cast<T>(static_cast<A>(x) * r * rms_factor<T, A>(w, how));
  return static_cast<T>(rounded<T>(static_cast<A>(x) * r) * static_cast<A>(w));
}

/** RMSNorm's input gradient: r g - x r^3 c, with g = gy * rms_factor and c
 * the row's mean of g x. */
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

/** GELU's tanh approximation's constants, as PyTorch's kernels spell them:
 * sqrt(2 / pi) and 0.044715. */
template <class A>
QUANTA_HD inline A gelu_beta() {
  return static_cast<A>(1.41421356237309504880 * 1.12837916709551257390 * 0.5);
}
template <class A>
QUANTA_HD inline A gelu_kappa() {
  return static_cast<A>(0.044715);
}

/** The argument of the activation's one transcendental function, whose
 * value e the functions below take: silu's exp(-x), gelu_tanh's
 * tanh(beta (x + kappa x^3)). Computed apart so that the CPU can take a
 * whole piece's exp or tanh as one vector op. */
template <GatedAct Act, class A>
QUANTA_HD inline A gated_arg(A x) {
  if constexpr (Act == GatedAct::silu)
    return -x;
  else
    return gelu_beta<A>() * (x + gelu_kappa<A>() * (x * x * x));
}
/** e from that argument: exp for silu, tanh for gelu_tanh. */
template <GatedAct Act, class A>
QUANTA_HD inline A gated_transcendental(A arg) {
  if constexpr (Act == GatedAct::silu)
    return std::exp(arg);
  else
    return std::tanh(arg);
}

/** act(x) from gate x and its e, rounded to T as transformers' act_fn(gate)
 * tensor is: silu x / (1 + e) (below about -88 in f32 e is inf and silu -0,
 * its limit); gelu_tanh 0.5 x (1 + e), PyTorch's formula. */
template <GatedAct Act, class T, class A>
QUANTA_HD inline A gated_act(A x, A e) {
  if constexpr (Act == GatedAct::silu)
    return rounded<T>(x / (A(1) + e));
  else
    return rounded<T>(A(0.5) * x * (A(1) + e));
}

/** d act / dx from x and e, as PyTorch's silu and gelu (tanh) backward
 * kernels form it: silu s (1 + x (1 - s)) with s = 1 / (1 + e); gelu_tanh
 * 0.5 (1 + e) + 0.5 x (1 - e^2) beta (1 + 3 kappa x^2). */
template <GatedAct Act, class A>
QUANTA_HD inline A gated_act_slope(A x, A e) {
  if constexpr (Act == GatedAct::silu) {
    const A s = A(1) / (A(1) + e);
    return s * (A(1) + x * (A(1) - s));
  } else {
    const A left = A(0.5) * x, right = A(1) + e;
    const A inner_slope = gelu_beta<A>() * (A(1) + A(3) * gelu_kappa<A>() * (x * x));
    return A(0.5) * right + left * (A(1) - e * e) * inner_slope;
  }
}

/** The gated MLP's output: act(x) as above, times up u. */
template <GatedAct Act, class T, class A>
QUANTA_HD inline T gated_out(A x, A e, A u) {
  return static_cast<T>(gated_act<Act, T>(x, e) * u);
}

/** Its gradients for output gradient g: d_up = g act(x), and d_gate = (g u)
 * act'(x), where g u is rounded to T (mul's gradient, a tensor of dtype T)
 * and the slope is formed in A and the product rounded once, as PyTorch's
 * activation backward forms it. */
template <GatedAct Act, class T, class A>
QUANTA_HD inline T gated_grad_up(A x, A e, A g) {
  return static_cast<T>(g * gated_act<Act, T>(x, e));
}
template <GatedAct Act, class T, class A>
QUANTA_HD inline T gated_grad_gate(A x, A e, A u, A g) {
  return static_cast<T>(rounded<T>(g * u) * gated_act_slope<Act>(x, e));
}

/** Attention's logit soft-capping (Gemma 2): a score s becomes
 * cap tanh(s / cap), its gradient scaled by 1 - tanh^2; cap 0: none. t is
 * tanh(s / cap). */
template <class A>
QUANTA_HD inline A softcap_tanh(A s, A cap) {
  return std::tanh(s / cap);
}
template <class A>
QUANTA_HD inline A softcap_slope(A t) {
  return A(1) - t * t;
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

/** The first key query i may see under a causal mask with a sliding window
 * of `window` keys, its own included (transformers' sliding_window: key j
 * when last - window < j <= last); 0 for no window. */
QUANTA_HD inline int64_t first_visible_key(int64_t i, int64_t q_len, int64_t kv_len,
                                           int64_t window) {
  if (window <= 0) return 0;
  const int64_t first = last_visible_key(i, q_len, kv_len) - window + 1;
  return first > 0 ? first : 0;
}

/** The last query that sees key j under that window (q_len - 1 without one;
 * may be below the first seeing query when none does). */
QUANTA_HD inline int64_t last_seeing_query(int64_t j, int64_t q_len, int64_t kv_len,
                                           int64_t window) {
  if (window <= 0) return q_len - 1;
  const int64_t i = j + window - 1 - (kv_len - q_len);
  return i < q_len - 1 ? i : q_len - 1;
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
