#pragma once
// Which training examples each step reads: the same on every rank and after
// every --resume, without communication.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta::train {

/** The global batch of training step `step` (0-based): positions into the
 * training set, a pure function of (seed, step, n, batch_size) so a resumed
 * run reads exactly the batches the uninterrupted one would. Epoch e =
 * step / ceil(n / batch_size) visits randperm(n) drawn from
 * Generator::named(seed, "data-order").fork("epoch-<e>"); its last batch may be
 * smaller. */
Tensor batch_indices(uint64_t seed, int64_t step, int64_t n, int64_t batch_size);

/** batch_indices() for consecutive steps, drawing each epoch's permutation
 * once instead of once per step (randperm of the 60000 training images costs
 * a few percent of a step). batch(step) == batch_indices(seed, step, n,
 * batch_size) for every step, in any order. */
class BatchOrder {
 public:
  BatchOrder(uint64_t seed, int64_t n, int64_t batch_size);
  Tensor batch(int64_t step);

 private:
  uint64_t seed_;
  int64_t n_, batch_size_;
  int64_t epoch_ = -1;  // whose permutation perm_ holds
  Tensor perm_;
};

/** Rank `rank`'s contiguous share of a global batch (its positions, in rank
 * order: rows [b r / W, b (r + 1) / W) of b), so the ranks' shares laid end
 * to end are the batch one process would take. */
Tensor rank_share(const Tensor& batch, int rank, int world);

}  // namespace quanta::train
