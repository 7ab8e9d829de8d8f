#pragma once
// Softmax and log-softmax along one dim, computed stably (the row maximum is
// subtracted first). Integer inputs compute in f32.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta {

/** exp(x) / sum(exp(x)) along `dim`; each slice along `dim` sums to 1. */
Tensor softmax(const Tensor& x, int64_t dim);
/** x - logsumexp(x) along `dim`, without forming softmax first. */
Tensor log_softmax(const Tensor& x, int64_t dim);

}  // namespace quanta
