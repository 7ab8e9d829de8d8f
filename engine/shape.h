#pragma once
// Shapes and strides (in elements) and the rules that combine them.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta {

using Shape = std::vector<int64_t>;

/** Product of the sizes (1 for a 0-d shape, 0 if any size is 0). */
int64_t numel_of(const Shape& shape);
/** Row-major strides for `shape`. */
Shape contiguous_strides(const Shape& shape);
/** NumPy broadcast of two shapes; throws naming `op` when they do not fit. */
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
/** Wraps a possibly negative dim into [0, ndim); throws naming `op`. */
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
/** Sorted, unique, wrapped dims; empty input means all dims. */
std::vector<int64_t> wrap_dims(const std::vector<int64_t>& dims, int64_t ndim,
                               const char* op);
/** "[2, 3, 4]" */
std::string shape_str(const Shape& shape);

}  // namespace quanta
