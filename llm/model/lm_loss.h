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

/** chunked_causal_lm_loss's chunk: a few [chunk, vocab] f32 tensors are
 * alive at once (134 MB for Llama 3's vocabulary), the GEMMs still large. */
inline constexpr int64_t kLossChunkTokens = 256;

/** The same loss from the final hidden states [batch, tokens, hidden] and the
 * output projection's weight [vocab, hidden], computing the logits
 * `chunk_tokens` positions at a time (in the weight's dtype, then upcast,
 * as the model's lm_head would), so that [tokens, vocab] f32 logits are
 * never all alive. When the result will be differentiated, the forward also
 * forms the gradients chunk by chunk (the logits are computed once; the
 * weight's gradient only when the weight requires grad) and the backward
 * scales them, so the loss can be differentiated once (a second backward
 * throws). Equal to causal_lm_loss(linear(hidden, weight), labels). */
Tensor chunked_causal_lm_loss(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                              int64_t chunk_tokens = kLossChunkTokens, int64_t ignore_index = -100);

}  // namespace quanta::llm
