#pragma once
// Text generation with a KV cache: the prompt in one forward, then one token
// per forward; greedy (temperature 0, as transformers' do_sample=False) or
// sampled with temperature and nucleus (top-p) filtering.
#include <cstdint>
#include <vector>

#include "llm/model/causal_lm.h"

namespace quanta::llm {

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  /** 0: greedy (the most likely token, the first on ties); > 0: sample from
   * softmax(logits / temperature). */
  double temperature = 0.0;
  /** Sampling keeps the most likely tokens whose probabilities first reach
   * top_p (at least one); 1 keeps all. */
  double top_p = 1.0;
  /** The sampler's Philox seed: the same seed gives the same tokens. */
  uint64_t seed = 0;
  /** Stop after generating any of these tokens (it is returned); empty:
   * generate max_new_tokens. (eos_token_ids(dir) reads a folder's.) */
  std::vector<int64_t> eos_token_ids{};
};

/** The new token ids after `prompt` (ids < vocab_size, at least one). */
std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options = {});

}  // namespace quanta::llm
