#include "engine/shape.h"

#include <algorithm>
#include <stdexcept>

namespace quanta {

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

std::optional<int64_t> checked_numel(const Shape& shape) {
  int64_t n = 1, span = 1;
  for (int64_t s : shape) {
    const auto next_n = checked_mul(n, s);
    const auto next_span = checked_mul(span, std::max<int64_t>(s, 1));
    if (!next_n || !next_span) return std::nullopt;
    n = *next_n;
    span = *next_span;
  }
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = acc;
    acc *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      throw std::invalid_argument(std::string("[") + op + "] shapes " + shape_str(a) + " and " +
                                  shape_str(b) + " cannot be broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t lo = -std::max<int64_t>(ndim, 1), hi = std::max<int64_t>(ndim, 1) - 1;
  if (dim < lo || dim > hi)
    throw std::invalid_argument(std::string("[") + op + "] dim " + std::to_string(dim) +
                                " out of range for a " + std::to_string(ndim) + "-d tensor");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

std::vector<int64_t> wrap_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t i = 0; i < ndim; ++i) out.push_back(i);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, ndim, op));
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end())
    throw std::invalid_argument(std::string("[") + op + "] a dim is repeated");
  return out;
}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace quanta
