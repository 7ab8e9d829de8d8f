#include "train/batch_order.h"

#include <algorithm>
#include <string>

#include "engine/random/generator.h"
#include "engine/random/sampling.h"

namespace quanta::train {
namespace {

Tensor epoch_permutation(uint64_t seed, int64_t epoch, int64_t n) {
  Generator gen = Generator::named(seed, "data-order").fork("epoch-" + std::to_string(epoch));
  return randperm(n, gen);
}

}  // namespace

Tensor batch_indices(uint64_t seed, int64_t step, int64_t n, int64_t batch_size) {
  return BatchOrder(seed, n, batch_size).batch(step);
}

BatchOrder::BatchOrder(uint64_t seed, int64_t n, int64_t batch_size)
    : seed_(seed), n_(n), batch_size_(batch_size) {}

Tensor BatchOrder::batch(int64_t step) {
  const int64_t per_epoch = (n_ + batch_size_ - 1) / batch_size_;
  const int64_t epoch = step / per_epoch, k = step % per_epoch;
  if (epoch != epoch_) {
    perm_ = epoch_permutation(seed_, epoch, n_);
    epoch_ = epoch;
  }
  return perm_.narrow(0, k * batch_size_, std::min(batch_size_, n_ - k * batch_size_));
}

Tensor rank_share(const Tensor& batch, int rank, int world) {
  const int64_t b = batch.size(0);
  const int64_t lo = b * rank / world, hi = b * (rank + 1) / world;
  return batch.narrow(0, lo, hi - lo);
}

}  // namespace quanta::train
