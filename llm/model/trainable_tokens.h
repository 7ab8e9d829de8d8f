#pragma once
// Trained rows of a frozen embedding or output weight (PEFT's trainable
// tokens, LoraConfig.trainable_token_indices): the chosen token rows take
// trained values while the rest of the vocabulary stays as it is, for
// tokens a base model never learned (a chat template's special tokens).
// CausalLM hangs one under the layer it changes as "token_adapter", so its
// parameter is named as PEFT saves it:
// "model.embed_tokens.token_adapter.trainable_tokens_delta".
#include <cstdint>
#include <vector>

#include "engine/nn/module.h"

namespace quanta::llm {

class TrainableTokens : public Module {
 public:
  /** Rows `indices` (distinct, in [0, rows)) of `weight` [rows, dim]: the
   * parameter "trainable_tokens_delta" [indices, dim] starts as those rows
   * (PEFT's initialisation: the layer starts as it was), in the weight's
   * dtype, on its device. Throws std::invalid_argument naming a bad index. */
  TrainableTokens(const Tensor& weight, std::vector<int64_t> indices);
  /** `weight` with the rows replaced by the trained values, as a new tensor
   * (PEFT's index_copy): the gradient reaches the values, not the weight. */
  Tensor apply(const Tensor& weight) const;
  /** embedding(apply(weight), ids, padding_idx) without the vocabulary-sized
   * copy or gradient: the lookup in `weight`, the trained rows' positions
   * taken from the values, whose gradient sums only the positions that read
   * them (a trained `padding_idx` row gets none, as in the embedding); a
   * weight that trains gets the gradient apply() would give it (none at the
   * trained rows). */
  Tensor lookup(const Tensor& weight, const Tensor& ids, int64_t padding_idx = -1) const;
  const std::vector<int64_t>& indices() const { return indices_; }
  /** The indices as an i64 tensor [indices] on the values' device. */
  const Tensor& rows() const { return rows_; }
  /** The trained rows [indices, dim]. */
  const Tensor& values() const { return values_; }

 private:
  std::vector<int64_t> indices_;
  Tensor values_, rows_;
  // scatter's index [indices, dim]: row i's position, on the values' device.
  Tensor index_;
  // [rows]: each row's place among the indices, indices.size() for a row
  // that does not train (lookup's row of the values table padded by one).
  Tensor slot_;
};

}  // namespace quanta::llm
