#pragma once
// The k largest entries along the last dimension: a layer's k nearest codes
// (its distances' top k) and a beam search's best candidates. k is small
// there (a beam), so k argmax passes over the rows, on any device with argmax
// and scatter kernels, beat a sort of every row.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta::quant {

/** Indices (i64 [..., k]) of the k largest values along the last dim of `x`
 * [..., n], largest first, ties to the lower index (argmax's rule); with
 * `largest` false the k smallest, smallest first (argmin's rule). No
 * gradient. 1 <= k <= n. */
Tensor top_indices(const Tensor& x, int64_t k, bool largest = true);

}  // namespace quanta::quant
