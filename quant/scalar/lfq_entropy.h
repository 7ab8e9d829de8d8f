#pragma once
// LFQ's entropy terms. Token t (of one codebook) has the code distribution
// p_t(c) = softmax_c(2 * inv_temperature * x_t . c) over all 2^d codes
// c in {-m, +m}^d. The logit is a sum over bits, so p_t is a product of
// independent per-bit distributions with P(bit j = 1) = sigmoid(z_tj),
// z_tj = 4 * inv_temperature * m * x_tj ("bit logits").
//
// The reference takes entropies as H(p) = -sum_c p_c log(max(p_c, eps)),
// eps = 1e-5, and the clamp is not a detail: for d >= 17 a near-uniform p_t
// has every p_c < eps. Both terms below reproduce it exactly.
//
// * Per-sample entropy. With K_t = {c : p_t(c) >= eps} and sum_c p_t(c) = 1,
//     H_eps(p_t) = -log(eps) - sum_{c in K_t} p_t(c) (log p_t(c) - log(eps)).
//   K_t holds at most 1/eps codes and is enumerated without touching the
//   others: flipping bit j of the most likely code lowers log p by |z_tj|, so
//   a depth-first walk over flip sets, bits sorted by |z|, stops at the first
//   flip that leaves K_t. Cost O(|K_t| + d log d) per token: a handful of
//   codes for confident tokens, 2^d for a uniform one with d <= 16.
// * Batch entropy needs the mean distribution (1/T) sum_t p_t over all 2^d
//   codes; a mean of products is no product, but each p_t is an outer product
//   A_t (x) B_t of the distributions over the high d/2 and the low d/2 bits, so
//   the sum over tokens is one GEMM A^T B ([2^(d/2), T] x [T, 2^(d - d/2)]):
//   T * 2^d multiply-adds instead of the direct path's T * 2^d * d for the
//   distances plus T * 2^d exponentials and logarithms, and no T x 2^d tensor.
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/tensor.h"
#include "quant/kernels/table.h"

namespace quanta::quant {

/** The batch mean of per-token code distributions: (sum over tokens
 * [C, 2^d], token count) -> mean [C, 2^d]. Must be differentiable in the
 * sum. The default divides by the count (the sum itself when the count is 0).
 * A distributed run replaces it with a token-weighted cross-rank mean. */
using TokenMean = std::function<Tensor(const Tensor& sum, int64_t count)>;

/** sum / count, or sum when count == 0 (so an empty batch gives zeros). */
Tensor local_token_mean(const Tensor& sum, int64_t count);

/** The two entropy terms of LFQ (unweighted, as the reference's breakdown). */
struct LFQEntropy {
  /** mean over tokens and codebooks of H_eps(p_t); 0 for no tokens. */
  Tensor per_sample;
  /** mean over codebooks of H_eps(mean over tokens of p_t). */
  Tensor batch;
};

// kEntropyEps (1e-5), the reference's clamp: entropies use
// log(max(p, kEntropyEps)); defined with the kernels (quant/kernels/table.h).

/** Factorised path from bit logits z [T, C, d] (any floating dtype; the
 * per-sample walk runs in f64). Exact, differentiable in z. */
LFQEntropy lfq_entropy_factorised(const Tensor& bit_logits, const TokenMean& mean);

/** Direct path: x [T, C, d] against every code of `codebook` [2^d, d]
 * (already scaled and normalised as LFQ uses it), materialising the
 * [T, C, 2^d] distributions as the reference does. The test oracle and the
 * benchmark's baseline. */
LFQEntropy lfq_entropy_direct(const Tensor& x, const Tensor& codebook, double inv_temperature,
                              const TokenMean& mean);

/** Per-token H_eps of the product distribution with bit logits z [R, d]:
 * [R] (the per-sample walk above; differentiable in z). */
Tensor clamped_bit_product_entropy(const Tensor& bit_logits);

/** Product distributions of independent bits: pi [R, k, 2] (row r, bit j:
 * P(0), P(1)) -> [R, 2^k], code index bits most significant first.
 * Differentiable in pi (f32 / f64; the bit_product kernels). */
Tensor bit_product_distribution(const Tensor& pi);

/** The bit probabilities of bit_logits [rows, d] split after bit `high`:
 * {pi [rows, high, 2], pi [rows, d - high, 2]}, each (P(0), P(1)) =
 * (sigmoid(-z), sigmoid(z)) by the engine's sigmoid functor, contiguous.
 * Differentiable in the logits: dz = (g1 - g0) P(0) P(1), one launch a half
 * each way (f32 / f64; the bit_probabilities kernels). */
std::vector<Tensor> bit_probability_halves(const Tensor& bit_logits, int64_t high);

}  // namespace quanta::quant
