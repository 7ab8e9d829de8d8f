#pragma once
// A model folder of random Llama weights (f32, written by save_causal_lm) of
// chosen sizes, for tests that need more bytes than the tiny fixtures hold.
#include <cstdint>
#include <filesystem>
#include <string>

#include "engine/random/generator.h"
#include "llm/model/causal_lm.h"
#include "llm/model/model_folder.h"

namespace quanta::testing {

struct RandomLlama {
  int64_t vocab = 64, hidden = 128, intermediate = 256, layers = 4;
  int64_t heads = 4, kv_heads = 4, head_dim = 32;
  bool tied = false;
};

/** Writes a RandomLlama of `sizes` to folder `dir`; returns the bytes of its
 * model.safetensors. */
inline int64_t write_random_llama(const std::string& dir, const RandomLlama& sizes, uint64_t seed) {
  llm::DecoderConfig c;
  c.vocab_size = sizes.vocab, c.hidden_size = sizes.hidden;
  c.intermediate_size = sizes.intermediate, c.num_hidden_layers = sizes.layers;
  c.num_attention_heads = sizes.heads, c.num_key_value_heads = sizes.kv_heads;
  c.head_dim = sizes.head_dim;
  c.tie_word_embeddings = sizes.tied;
  c.max_position_embeddings = 64;
  c.rope = {.theta = 10000, .head_dim = sizes.head_dim, .max_position_embeddings = 64};
  Generator gen(seed);
  llm::save_causal_lm(*llm::CausalLM::random(c, gen), dir);
  return static_cast<int64_t>(std::filesystem::file_size(dir + "/model.safetensors"));
}

}  // namespace quanta::testing
