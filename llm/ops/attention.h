#pragma once
// Scaled dot-product attention for decoders: causal and additive masks,
// grouped-query heads read without copies, memory linear in the lengths
// (a tiled online softmax; the backward recomputes the tiles).
#include <optional>

#include "engine/tensor.h"

namespace quanta::llm {

struct AttentionOptions {
  /** Query i sees key j only when j <= i + kv_len - q_len (the queries are
   * the last positions, as with a KV cache; plain causal when the lengths
   * are equal). */
  bool causal = false;
  /** Multiplies q.k; unset: head_dim^-0.5 (transformers' `scaling`). */
  std::optional<double> scale{};
  /** Gemma 2's logit soft-capping: the scaled score x becomes softcap *
   * tanh(x / softcap) before the mask is added; 0: none. */
  double softcap = 0.0;
  /** A sliding window (with causal only): query i sees only the last
   * `window` keys up to its own position, its own included (transformers'
   * sliding_window: Mistral, Qwen2's sliding layers, Gemma 2's every other
   * layer); 0: none. */
  int64_t window = 0;
  /** Optional, broadcast to [batch, heads, q_len, kv_len]: floating, added to
   * the scores (-inf hides a key), or bool, true where a query may see a key
   * (PyTorch's convention). Not differentiated. */
  Tensor mask{};
};

/** softmax(scale q k^T + mask) v per head (soft-capped when asked), for q [batch, q_len, heads,
 * head_dim] and k, v [batch, kv_len, kv_heads, head_dim] (the layout the
 * projections give, not PyTorch's [batch, heads, len, dim]); heads is a
 * multiple of kv_heads and query head h reads key head h / (heads /
 * kv_heads). Returns [batch, q_len, heads, head_dim] in q's dtype (f32, f64,
 * bf16 or f16, all three alike), accumulating in f32 (f64 for f64). A query
 * that sees no key gets zeros. Differentiable in q, k and v. */
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& options = {});

}  // namespace quanta::llm
