#pragma once
// Rotary position embeddings as Hugging Face transformers computes and
// applies them: inverse frequencies from rope_theta and the config's scaling
// kind, cos and sin tables per position, and `x * cos + rotate_half(x) * sin`
// on each head (the first and second halves of a head are the pairs).
#include <cstdint>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace quanta::llm {

/** A config's `rope_scaling` (transformers 4.x) or the scaling part of its
 * `rope_parameters` (5.x). */
struct RopeScaling {
  /** "default" (none), "linear", "dynamic", "llama3", "longrope" or
   * "yarn"; any other kind is refused by name. */
  std::string type = "default";
  double factor = 1.0;
  // llama3 only:
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3, longrope and yarn:
  int64_t original_max_position_embeddings = 0;
  // longrope (Phi-3.5, Phi-4-mini) only: each frequency's divisor (head_dim
  // / 2 of them) for sequences up to original_max_position_embeddings
  // (short) and past it (long), and the factor cos and sin are multiplied
  // by (0: sqrt(1 + ln factor / ln original_max_position_embeddings), 1
  // when factor <= 1).
  std::vector<double> short_factor, long_factor;
  // longrope and yarn: the factor cos and sin are multiplied by; 0: derived
  // (yarn: 0.1 ln factor + 1, or mscale's ratio where mscale and
  // mscale_all_dim are both set).
  double attention_factor = 0;
  // yarn (Qwen2.5's and Qwen3's long contexts, OLMo 3, DeepSeek) only: the
  // rotation counts bounding the blend between interpolated and kept
  // frequencies (0: 32 and 1, as transformers reads a missing or zero
  // value), DeepSeek's mscale pair (0: unset), and whether the blend's
  // bounds are rounded outwards to whole dimensions.
  double beta_fast = 0;
  double beta_slow = 0;
  double mscale = 0;
  double mscale_all_dim = 0;
  bool truncate = true;
};

/** What the frequencies depend on. */
struct RopeConfig {
  double theta = 10000.0;
  /** The rotated part of a head: all of it, or the first
   * partial_rotary_factor of it (Phi-4-mini's 0.75), the rest passed
   * through. Even, >= 2. */
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;  // dynamic scaling starts past it
  RopeScaling scaling{};
};

/** The inverse frequencies (head_dim / 2, in f32 as transformers computes
 * them) and the factor cos and sin are multiplied by. */
struct RopeFrequencies {
  std::vector<float> inv_freq;
  double attention_scaling = 1.0;
};

/** The frequencies of `config` for sequences of `seq_len` positions (only
 * "dynamic" and "longrope" depend on it: dynamic rescales theta when
 * seq_len is over max_position_embeddings, as transformers does for the
 * longest sequence it has seen; longrope takes its long factors when
 * seq_len is over original_max_position_embeddings, as transformers does
 * for each forward's largest position + 1). Throws naming the config value
 * that is wrong. */
RopeFrequencies rope_frequencies(const RopeConfig& config, int64_t seq_len = 0);

/** cos and sin [batch, tokens, head_dim / 2] of positions [batch, tokens]
 * (i64, on the device the tables go to), in the accumulation dtype of
 * `dtype` (f64 for f64, else f32): angle = position * inv_freq, then cos and
 * sin times attention_scaling. batch may be 1 for every row of a batch. */
struct RopeTables {
  Tensor cos, sin;
};
RopeTables rope_tables(const RopeFrequencies& f, const Tensor& positions, DType dtype);

/** rope_tables of positions start .. start + tokens - 1 ([1, tokens,
 * head_dim / 2]) on `device`, the same values: made once (by rope_tables,
 * on the device) per frequencies, dtype and device for the longest run of
 * positions from 0 asked so far (up to 16384 positions; a run past them is
 * made for its call), each later call a view of its rows, so a training
 * step, a prefill or a decoded token launches nothing for them. Shared,
 * read-only (in-place ops refuse them) and kept for the process (a
 * captured step may read them at every replay). start >= 0, tokens >= 0. */
RopeTables sequence_rope_tables(const RopeFrequencies& f, int64_t start, int64_t tokens,
                                DType dtype, const Device& device);

/** The rotary embedding of x [batch, tokens, heads, head_dim] by `t`, in x's
 * dtype (f32, f64, bf16, f16), rounded as transformers rounds it in that
 * dtype. Tables of fewer than head_dim / 2 frequencies rotate the first
 * 2 x that many values of each head and pass the rest through (partial
 * rotary). Differentiable in x. */
Tensor apply_rope(const Tensor& x, const RopeTables& t);

}  // namespace quanta::llm
