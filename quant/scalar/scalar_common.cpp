#include "quant/scalar/scalar_common.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"

namespace quanta::quant::detail {

Tensor random_orthogonal(int64_t n, Generator& gen) {
  std::vector<double> a = randn({n, n}, gen, {.dtype = DType::f64}).to_vector<double>();
  // Modified Gram-Schmidt on the rows; a normal matrix is full rank with
  // probability one.
  for (int64_t i = 0; i < n; ++i) {
    double* ri = a.data() + i * n;
    for (int64_t j = 0; j < i; ++j) {
      const double* rj = a.data() + j * n;
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += ri[k] * rj[k];
      for (int64_t k = 0; k < n; ++k) ri[k] -= dot * rj[k];
    }
    double norm = 0;
    for (int64_t k = 0; k < n; ++k) norm += ri[k] * ri[k];
    norm = std::sqrt(norm);
    for (int64_t k = 0; k < n; ++k) ri[k] /= norm;
  }
  return from_vector<double>(a, {n, n}).to(DType::f32);
}

Tensor soft_clamp(const Tensor& x, const Tensor& v) { return tanh(x / v) * v; }

Tensor features_to_dim1(const Tensor& x) {
  std::vector<int64_t> order{0, x.dim() - 1};
  for (int64_t i = 1; i + 1 < x.dim(); ++i) order.push_back(i);
  return permute(x, order);
}

Tensor index_digits(const Tensor& indices, const std::vector<int64_t>& basis,
                    const std::vector<int64_t>& levels, int64_t codebook_size,
                    const std::string& who) {
  if (is_floating(indices.dtype()))
    throw std::invalid_argument("[" + who + "] indices must be integers, got " +
                                std::string(dtype_name(indices.dtype())));
  const size_t d = levels.size();
  const std::vector<int64_t> idx = indices.to_vector<int64_t>();
  std::vector<int32_t> out(idx.size() * d);
  for (size_t t = 0; t < idx.size(); ++t) {
    if (idx[t] < 0 || idx[t] >= codebook_size)
      throw std::invalid_argument("[" + who + "] index " + std::to_string(idx[t]) +
                                  " outside [0, " + std::to_string(codebook_size) + ")");
    for (size_t i = 0; i < d; ++i)
      out[t * d + i] = static_cast<int32_t>((idx[t] / basis[i]) % levels[i]);
  }
  Shape s = indices.shape();
  s.push_back(static_cast<int64_t>(d));
  return from_vector<int32_t>(out, s).to(indices.device());
}

}  // namespace quanta::quant::detail
