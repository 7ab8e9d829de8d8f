#pragma once
// Lays a tensor out for a reduction: kept dims first, reduced dims last, so
// every output element reduces one contiguous row of `inner` values, the
// layout the kernel tables' row reductions take. A view plus one strided copy
// on the tensor's own device.
#include <vector>

#include "engine/tensor.h"

namespace quanta::detail {

struct ReducePlan {
  Tensor rows;                // contiguous; logically [outer, inner]
  int64_t outer = 1;          // number of output elements
  int64_t inner = 1;          // values reduced into each
  Shape out_shape;            // result shape (keepdim applied)
  Shape kept_shape;           // result shape with reduced dims kept as size 1
  std::vector<int64_t> dims;  // wrapped, sorted reduced dims
};

/** Plans reducing `x` over `dims` (empty = all); no graph is recorded. */
ReducePlan plan_reduce(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                       const char* op);

}  // namespace quanta::detail
