#pragma once
// What a training forward learns about a codebook, kept apart from the
// codebook itself. A forward only ADDS to these (local, no communication);
// Codebook::apply_ema_update and Codebook::expire_codes read them later. A
// distributed wrapper reduces them across ranks in between (DESIGN.md,
// "Distributed rules"), so the forward never assumes anything about ranks.
#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace quanta::quant {

/** Pending statistics of one Codebook ([G] codebooks of K codes of D dims). */
struct CodebookStatistics {
  /** Per-code assignment counts, [G, K] f32, folded over forwards: after s
   * accumulated forwards with counts n_1..n_s it holds sum_i decay^(s-i) n_i,
   * so applying is cluster_size <- decay^s cluster_size + (1 - decay) counts
   * (one lerp per forward, as the reference does). Linear in the counts:
   * ranks may sum it. With one forward per step it holds whole numbers, so
   * the sum over ranks is exact and equals one process's count bit for bit;
   * dead-code decisions (cluster_size < threshold) then cannot depend on how
   * the batch was split. */
  Tensor counts;
  /** The same for embed_avg, [G, K, D]: folded sums of assigned vectors. */
  Tensor sums;
  /** Valid (unmasked) tokens seen per codebook, [G] f32 (raw, not folded). */
  Tensor tokens;
  /** Forwards accumulated since the last apply (the s above). */
  int64_t steps = 0;
  /** Candidate rows for dead-code replacement, one [C_i, D] tensor per
   * codebook and forward: every valid row of each forward's batch (the input
   * after projection and normalisation, masked tokens excluded), in token
   * order. Keeping all rows, not a local sample, is what lets a distributed
   * run pool them across ranks in rank order and draw the replacements
   * exactly as one process would from the whole batch. */
  std::vector<std::vector<Tensor>> candidates;
  /** k-means samples, one [S_i, D] tensor per codebook and forward, gathered
   * while the codebook awaits initialisation and initialisation is deferred
   * to the reconciliation point (VectorQuantize without update_in_forward). */
  std::vector<std::vector<Tensor>> init_samples;

  /** affine_param's batch statistics while their update is deferred (see
   * Codebook::accumulate_affine): valid rows per table [G], and their sum and
   * sum of squares [G, 1, D]. Linear: ranks may sum them. Undefined when
   * nothing was accumulated. */
  Tensor affine_count, affine_sum, affine_sumsq;

  /** True when no statistics have been accumulated. */
  bool empty() const { return steps == 0; }
};

}  // namespace quanta::quant
