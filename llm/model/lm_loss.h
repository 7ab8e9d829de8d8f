#pragma once
// The causal language-model loss as transformers computes it: each position
// predicts the next token's label, logits upcast to f32, labels equal to
// ignore_index (-100) left out, the mean over the rest.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta::llm {

/** Mean cross-entropy of logits [batch, tokens, vocab] at positions
 * 0..tokens-2 against labels [batch, tokens] (i64) at 1..tokens-1; NaN when
 * every label is ignored (as transformers). Differentiable in logits. */
Tensor causal_lm_loss(const Tensor& logits, const Tensor& labels, int64_t ignore_index = -100);

/** chunked_causal_lm_loss's automatic chunk: as many positions as keep one
 * chunk's f32 logits within this many bytes (one [chunk, vocab] tensor is
 * alive at a time), a multiple of 64, at least 64: 1024 positions of a
 * 32000-token vocabulary, 256 of Llama 3's. Fewer, larger chunks repack the
 * [vocab, hidden] weight fewer times: the ~500M config's loss (2048
 * positions, vocabulary 32000) took 755 ms in chunks of 256, 718 in 512,
 * 687 in 1024, against 653 for its two products whole. */
inline constexpr int64_t kLossChunkBytes = int64_t{128} << 20;

/** The automatic chunk (kLossChunkBytes) for a vocabulary of `vocab`. */
int64_t loss_chunk_tokens(int64_t vocab);

/** chunked_causal_lm_loss's settings beyond its three tensors. */
struct LmLossOptions {
  /** Positions whose logits are computed at a time; 0: loss_chunk_tokens
   * of the vocabulary. */
  int64_t chunk_tokens = 0;
  int64_t ignore_index = -100;
  /** trained_rows (i64 [n], distinct) with trained_values [n, hidden]: the
   * only rows of the output weight that train (trainable tokens,
   * CausalLM::lm_head_trained_rows and lm_head_trained_values), the weight
   * holding those values at those rows. The weight is then read as a
   * constant (and let go when the forward ends) and the gradient goes to
   * trained_values, formed from the logits' gradient at those columns
   * alone: no vocabulary-sized product or gradient is made. */
  Tensor trained_rows{};
  Tensor trained_values{};
  /** Gemma 2's final_logit_softcapping: each logit x becomes cap * tanh(x /
   * cap) in the weight's dtype before the upcast, as transformers forms
   * them; 0: none. */
  double logit_softcap = 0;
  /** Granite's logits_scaling: each logit divided by it in the weight's
   * dtype (before any cap), as scale_logits; 1: none. */
  double logit_divisor = 1;
};

/** The same loss from the final hidden states [batch, tokens, hidden] and the
 * output projection's weight [vocab, hidden], computing the logits
 * `options.chunk_tokens` positions at a time, in the weight's dtype, then
 * upcast, as the model's lm_head would, so that [tokens, vocab] f32 logits
 * are never all alive. Each chunk's rows get their loss and, when the
 * result will be differentiated, their gradient from one kernel
 * (lm_loss_rows, in place over the logits); the forward forms the
 * gradients chunk by chunk (the logits are computed once; the weight's
 * gradient only when the weight requires grad) and the backward scales
 * them, so the loss can be differentiated once (a second backward throws).
 * A target outside the vocabulary other than ignore_index is an error.
 * Equal to causal_lm_loss(linear(hidden, weight), labels) (divided first by
 * options.logit_divisor, then soft-capped with options.logit_softcap). */
Tensor chunked_causal_lm_loss(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                              const LmLossOptions& options = {});

/** Gemma 2's final soft-capping of logits: cap * tanh(x / cap), each step
 * rounded to x's dtype as transformers' three ops round it; x itself for
 * cap 0. Differentiable. */
Tensor softcap_logits(const Tensor& logits, double cap);

/** Granite's final scaling of logits: logits / divisor, computed in f32 and
 * rounded once to the logits' dtype, as PyTorch divides a 16-bit tensor by
 * a Python number; the logits themselves for divisor 1. Differentiable. */
Tensor scale_logits(const Tensor& logits, double divisor);

}  // namespace quanta::llm
