#pragma once
// What an assignment of rows to codes says about a codebook: how many rows
// each code took and the sum of those rows. The EMA codebook update and
// k-means are built on it; distributed runs sum it across ranks (it is
// linear), so its bits must not depend on scheduling: the quantizer tables'
// code_statistics entry fixes the order of every addition.
#include <cstdint>

#include "engine/tensor.h"

namespace quanta::quant {

struct CodeStatistics {
  /** [K]: rows assigned to each code, in x's dtype (whole numbers). */
  Tensor counts;
  /** [K, D]: the sum of the rows assigned to each code (0 for unused codes). */
  Tensor sums;
};

/** The counts and sums of the rows of x [N, D] assigned by idx [N] (i64 or
 * i32 codes in [0, k), such as nearest_codes gives) to k codes, on x's
 * device and in its dtype, without gradient. f32 and f64 take the quantizer
 * table's kernel; other floating dtypes the engine's index_add. An index
 * outside [0, k) throws on the CPU; on a GPU, where checking would wait for
 * the device, it is not counted. */
CodeStatistics code_statistics(const Tensor& idx, const Tensor& x, int64_t k);

}  // namespace quanta::quant
