#pragma once
// Test-set evaluation: reconstruction error and how the codebook is used.
#include <cstdint>
#include <string>
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
  /** Adds each codebook's codes (TrainQuantizer::codes_per_codebook: one
   * tensor per codebook, any shape); throws naming the value when an index is
   * out of range. */
  void add(const std::vector<Tensor>& codes);
  /** Fraction of codes chosen at least once, averaged over codebooks; NaN
   * when there is no codebook. */
  double usage() const;
  /** exp(entropy) of the code frequencies (the effective number of codes),
   * averaged over codebooks; NaN when there is no codebook or no count. */
  double perplexity() const;
  /** usage() of each codebook on its own, in index order. */
  std::vector<double> usage_per_codebook() const;
  /** perplexity() of each codebook on its own (NaN for one never counted). */
  std::vector<double> perplexity_per_codebook() const;
  /** Counts of each code summed over the codebooks (for the bar chart). */
  std::vector<double> totals() const;
};

/** Peak signal-to-noise ratio in dB of a mean squared error for signals in
 * [0, peak]: 10 log10(peak^2 / mse). Computed from the mean over every pixel
 * of a set (as torchmetrics' PeakSignalNoiseRatio does by default), not as a
 * mean of per-image ratios. +inf for mse 0, NaN for a negative or NaN mse. */
double psnr_db(double mse, double peak = 1.0);

/** One codebook's figures on the test set, for quantizers with several
 * (residual levels, groups, heads). */
struct CodebookFigures {
  std::string name;  // TrainQuantizer::codebook_name: "level 2", "group 1 level 3"
  double usage = 0;
  double perplexity = 0;
  std::vector<double> counts;  // times each code was chosen
};

/** Test-set figures. */
struct EvalResult {
  double mse = 0;         // mean squared error per pixel
  double psnr = 0;        // psnr_db(mse): the images are in [0, 1]
  double usage = 0;       // CodeCounts::usage
  double perplexity = 0;  // CodeCounts::perplexity
  int64_t samples = 0;
  std::vector<double> code_totals;  // CodeCounts::totals
  /** Each codebook on its own, in index order, when there are several;
   * empty for one codebook or none. */
  std::vector<CodebookFigures> per_codebook;
};

/** Evaluates `model` in eval mode, without gradients, on `images` [N, 1, 28,
 * 28] in batches of `batch_size`; restores the previous train/eval mode. */
EvalResult evaluate(VqVae& model, const Tensor& images, int64_t batch_size);

}  // namespace quanta::train
