#include "quant/hierarchical/resample.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/ops/linalg.h"
#include "engine/ops/view.h"

namespace quanta::quant {
namespace {

void check_sizes(const char* op, int64_t in, int64_t out) {
  if (in <= 0 || out <= 0)
    throw std::invalid_argument(std::string("[") + op + "] sizes must be positive, got in " +
                                std::to_string(in) + ", out " + std::to_string(out));
}

using MatrixOf = std::vector<double> (*)(int64_t, int64_t);

// [in, out] = the matrix transposed, so that a dim moved last multiplies from the left.
Tensor build_matrix(MatrixOf matrix_of, int64_t in, int64_t out, DType dtype,
                    const Device& device) {
  return contiguous(transpose(from_vector(matrix_of(in, out), {out, in}), 0, 1))
      .to(dtype)
      .to(device);
}

// Applies matrix_of(in, out) along every spatial dim whose size changes.
Tensor separable(const char* op, const Tensor& x, const std::vector<int64_t>& out,
                 MatrixOf matrix_of, ResampleMatrices* held) {
  const int64_t k = static_cast<int64_t>(out.size());
  if (x.dim() != k + 2)
    throw std::invalid_argument(std::string("[") + op + "] expected [B, C] and " +
                                std::to_string(k) + " spatial dims, got " +
                                std::to_string(x.dim()) + " dims");
  Tensor y = x;
  for (int64_t d = 0; d < k; ++d) {
    const int64_t in = x.shape()[static_cast<size_t>(d + 2)], o = out[static_cast<size_t>(d)];
    check_sizes(op, in, o);
    if (in == o) continue;  // both maps are the identity then
    const Tensor m = held ? held->get(matrix_of, in, o, x.dtype(), x.device())
                          : build_matrix(matrix_of, in, o, x.dtype(), x.device());
    y = transpose(matmul(transpose(y, d + 2, -1), m), d + 2, -1);
  }
  return contiguous(y);
}

}  // namespace

Tensor ResampleMatrices::get(MatrixOf matrix_of, int64_t in, int64_t out, DType dtype,
                             const Device& device) {
  const Key key{matrix_of, in, out, dtype, device.str()};
  auto it = held_.find(key);
  if (it == held_.end())
    it = held_.emplace(key, build_matrix(matrix_of, in, out, dtype, device)).first;
  return it->second;
}

std::vector<double> adaptive_avg_pool_matrix(int64_t in, int64_t out) {
  check_sizes("adaptive_avg_pool_nd", in, out);
  std::vector<double> m(static_cast<size_t>(in * out), 0.0);
  for (int64_t i = 0; i < out; ++i) {
    const int64_t start = (i * in) / out, end = ((i + 1) * in + out - 1) / out;
    for (int64_t j = start; j < end; ++j)
      m[static_cast<size_t>(i * in + j)] = 1.0 / static_cast<double>(end - start);
  }
  return m;
}

std::vector<double> interpolate_linear_matrix(int64_t in, int64_t out) {
  check_sizes("interpolate_linear_nd", in, out);
  std::vector<double> m(static_cast<size_t>(in * out), 0.0);
  const double scale = static_cast<double>(in) / static_cast<double>(out);
  for (int64_t i = 0; i < out; ++i) {
    const double src = std::max((static_cast<double>(i) + 0.5) * scale - 0.5, 0.0);
    const int64_t i0 = std::min(static_cast<int64_t>(std::floor(src)), in - 1);
    const int64_t i1 = std::min(i0 + 1, in - 1);
    const double l = src - static_cast<double>(i0);
    m[static_cast<size_t>(i * in + i0)] += 1.0 - l;
    m[static_cast<size_t>(i * in + i1)] += l;
  }
  return m;
}

Tensor adaptive_avg_pool_nd(const Tensor& x, const std::vector<int64_t>& out,
                            ResampleMatrices* held) {
  return separable("adaptive_avg_pool_nd", x, out, adaptive_avg_pool_matrix, held);
}

Tensor interpolate_linear_nd(const Tensor& x, const std::vector<int64_t>& out,
                             ResampleMatrices* held) {
  return separable("interpolate_linear_nd", x, out, interpolate_linear_matrix, held);
}

}  // namespace quanta::quant
