#pragma once
// Principal components of data seen a batch at a time (incremental PCA:
// Ross, Lim, Lin and Yang 2008, as scikit-learn's IncrementalPCA computes it
// and PEFT's port of it for EVA's adapter starts): the running mean and
// variance of the columns, and the top components of everything seen so far
// from one SVD per batch of [previous components scaled by their singular
// values; the batch centred; a mean correction]. Host-side, in f64; not
// recorded by autograd.
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta {

class IncrementalPCA {
 public:
  /** Keeps `components` components (>= 1). `lowrank_niter` < 0: each
   * update's SVD is exact; >= 0: approximated as torch.svd_lowrank(q = 2 x
   * components, niter) does (approximate_singular_triplets; PEFT's EVA uses
   * 4), every update's sketch drawn from `sketch` as given (the same
   * sketch each time, as PEFT reseeds torch's generator before each: fresh
   * ones would add their own error to what changes between updates).
   * Throws std::invalid_argument for components < 1. */
  explicit IncrementalPCA(int64_t components, int64_t lowrank_niter = -1,
                          std::optional<Generator> sketch = std::nullopt);

  /** Takes the rows of x [n, features] (f32 or f64, any device) into the
   * fit. Throws std::invalid_argument naming the problem for another rank
   * or dtype, fewer rows than components, more components than features,
   * features other than the first batch's, or a non-finite entry; the fit
   * is unchanged then. */
  void partial_fit(const Tensor& x);

  /** pcas[i]->partial_fit(rows[i]) for every i, the SVDs on the CPU's
   * threads at once (one matrix each, as top_singular_triplets of several
   * matrices): the same results as one at a time. Every batch is checked
   * before any fit changes; the fits must differ, and all use the exact SVD
   * or all the randomized one with the same iterations. */
  static void partial_fit_all(const std::vector<IncrementalPCA*>& pcas,
                              const std::vector<Tensor>& rows);

  bool fitted() const { return seen_ > 0; }
  int64_t samples_seen() const { return seen_; }
  int64_t n_components() const { return k_; }
  /** [components, features] (f64, on the CPU), orthonormal rows, each with
   * its entry of largest magnitude positive (scikit-learn's svd_flip on
   * the right vectors); in order of decreasing singular value. */
  Tensor components() const;
  /** [components] (f64): the singular values of the centred data seen. */
  Tensor singular_values() const;
  /** [components] (f64): each component's share of the total variance. */
  Tensor explained_variance_ratio() const;
  /** [features] (f64): the columns' mean and (biased) variance. */
  Tensor mean() const;
  Tensor var() const;

  /** The same values as the members above, for callers on the host. */
  const std::vector<double>& components_values() const { return components_; }
  const std::vector<double>& singular_values_values() const { return singular_values_; }
  const std::vector<double>& explained_variance_ratio_values() const { return ratio_; }

 private:
  // One update split at its SVD: what goes in, and what comes out.
  struct Update;
  Update prepare(const Tensor& x) const;
  void finish(Update& update, const Tensor& vh, const Tensor& s);

  int64_t k_ = 0, niter_ = -1, features_ = 0, seen_ = 0;
  std::optional<Generator> sketch_;
  std::vector<double> mean_, var_, components_, singular_values_, ratio_;
};

}  // namespace quanta
