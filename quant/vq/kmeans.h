#pragma once
// Lloyd's k-means as the reference uses it to initialise a codebook.
#include <cstdint>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta::quant {

/** Means and the cluster sizes of the last assignment. */
struct KMeansResult {
  /** [K, D] */
  Tensor means;
  /** [K] f32: rows assigned to each mean in the last iteration (before that
   * iteration's mean update, as the reference reports it); with 0
   * iterations, rows nearest to each seed. */
  Tensor bins;
};

/** k-means of `samples` [N, D] (N > 0) into `k` means: seeds are k rows drawn
 * from `gen` (without replacement when N >= k, else with), then `iters`
 * rounds of nearest-mean assignment and mean update (0: the seeds are the
 * means; the reference fails there); a mean that gets no rows keeps its
 * value. `cosine`: similarity is the dot product and means are
 * l2-normalised. No gradient. */
KMeansResult kmeans(const Tensor& samples, int64_t k, int64_t iters, bool cosine, Generator& gen);

/** Rows `m` drawn from `rows` [N, D] (N > 0) with `gen`: without replacement
 * (a random permutation's first m) when N >= m, else with replacement. */
Tensor sample_rows(const Tensor& rows, int64_t m, Generator& gen);
/** The row positions sample_rows draws, [m] int64 on `device`: they depend
 * only on (n, m, gen), so ranks that know the pooled size can agree on them
 * without holding the rows. */
Tensor sample_row_positions(int64_t n, int64_t m, Generator& gen, Device device = Device::cpu());

/** Mean squared distance of each sample to its nearest mean (for tests and
 * diagnostics). */
double kmeans_distortion(const Tensor& samples, const Tensor& means, bool cosine);

}  // namespace quanta::quant
