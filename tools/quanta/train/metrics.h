#pragma once
// Test-set evaluation: reconstruction error and how the codebook is used.
#include <cstdint>
#include <vector>

#include "engine/tensor.h"
#include "train/vqvae.h"

namespace quanta::train {

/** How often each code was chosen, per codebook. */
struct CodeCounts {
  int64_t codebook_size = 0;
  /** counts[q][k]: times code k of codebook q was chosen. */
  std::vector<std::vector<int64_t>> counts;

  /** Counts for `num_codebooks` codebooks of `codebook_size` codes. */
  CodeCounts(int64_t codebook_size, int64_t num_codebooks);
  /** Adds the codes in `indices` ([..] for one codebook, [.., Q] for Q);
   * throws naming the value when an index is out of range. */
  void add(const Tensor& indices);
  /** Fraction of codes chosen at least once, averaged over codebooks; NaN
   * when there is no codebook. */
  double usage() const;
  /** exp(entropy) of the code frequencies (the effective number of codes),
   * averaged over codebooks; NaN when there is no codebook or no count. */
  double perplexity() const;
  /** Counts of each code summed over the codebooks (for the bar chart). */
  std::vector<double> totals() const;
};

/** Test-set figures. */
struct EvalResult {
  double mse = 0;         // mean squared error per pixel
  double usage = 0;       // CodeCounts::usage
  double perplexity = 0;  // CodeCounts::perplexity
  int64_t samples = 0;
  std::vector<double> code_totals;  // CodeCounts::totals
};

/** Evaluates `model` in eval mode, without gradients, on `images` [N, 1, 28,
 * 28] in batches of `batch_size`; restores the previous train/eval mode. */
EvalResult evaluate(VqVae& model, const Tensor& images, int64_t batch_size);

}  // namespace quanta::train
