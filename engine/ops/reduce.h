#pragma once
// Reductions over one or several dims (empty `dims` = all dims). (nd) marks
// ops without a gradient.
#include <vector>

#include "engine/tensor.h"

namespace quanta {

using Dims = std::vector<int64_t>;

/** Sum over `dims`; bool and integers sum in i64, floats in their dtype. */
Tensor sum(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
/** Sums a broadcast gradient back down to `shape` (the backward of expand). */
Tensor sum_to(const Tensor& x, const Shape& shape);

}  // namespace quanta
