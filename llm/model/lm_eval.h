#pragma once
// Perplexity over a token file: its consecutive non-overlapping windows of
// seq_len tokens, each scored on its seq_len - 1 next-token predictions.
#include <cstdint>
#include <string>
#include <vector>

#include "llm/data/token_file.h"
#include "llm/model/causal_lm.h"

namespace quanta::llm {

struct WindowEval {
  /** The mean over windows of each window's mean token cross-entropy (what
   * averaging transformers' per-window `loss` gives). */
  double loss = 0;
  double perplexity = 0;  // exp(loss)
  int64_t windows = 0;
  int64_t tokens = 0;  // predictions scored: windows * (seq_len - 1)
};

/** Scores the file's first size() / seq_len windows, batch_size windows per
 * forward. Throws std::invalid_argument when seq_len is under 2 or over
 * max_position_embeddings, or the file holds less than one window; an id
 * >= vocab_size names the file and position. */
WindowEval evaluate_windows(CausalLM& model, const TokenFile& tokens, int64_t seq_len,
                            int64_t batch_size = 1);
/** The same over ids in memory (a tokenized text); `source` names them in
 * errors. */
WindowEval evaluate_windows(CausalLM& model, const std::vector<int64_t>& ids,
                            const std::string& source, int64_t seq_len, int64_t batch_size = 1);

}  // namespace quanta::llm
