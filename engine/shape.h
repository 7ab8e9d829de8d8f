#pragma once
// Shapes and strides (in elements) and the rules that combine them.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace quanta {

using Shape = std::vector<int64_t>;

/** Product of the sizes (1 for a 0-d shape, 0 if any size is 0). */
int64_t numel_of(const Shape& shape);
/** a * b for non-negative sizes, or std::nullopt when either is negative or the
 * product does not fit int64. Every size that comes from outside (a file's
 * header or metadata, a shape to allocate) is multiplied with this. */
std::optional<int64_t> checked_mul(int64_t a, int64_t b);
/** numel_of(shape), or std::nullopt when a size is negative or the element
 * count, or the product of the non-zero sizes (which strides multiply out),
 * does not fit int64. */
std::optional<int64_t> checked_numel(const Shape& shape);
/** Row-major strides for `shape`. */
Shape contiguous_strides(const Shape& shape);
/** NumPy broadcast of two shapes; throws naming `op` when they do not fit. */
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
/** Wraps a possibly negative dim into [0, ndim); throws naming `op`. */
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
/** Sorted, unique, wrapped dims; empty input means all dims. */
std::vector<int64_t> wrap_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op);
/** "[2, 3, 4]" */
std::string shape_str(const Shape& shape);

}  // namespace quanta
