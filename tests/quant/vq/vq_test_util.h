#pragma once
// Helpers shared by the quant_vq tests.
#include <functional>
#include <vector>

#include "quanta.h"

namespace quanta::testing {

/** Central-difference gradient of the scalar f at x (f64). */
inline Tensor numeric_grad(const std::function<double(const Tensor&)>& f, const Tensor& x,
                           double h = 1e-6) {
  Tensor base = x.detach().clone();
  std::vector<double> v = base.to_vector<double>(), g(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    std::vector<double> p = v, m = v;
    p[i] += h;
    m[i] -= h;
    g[i] = (f(from_vector<double>(p, base.shape())) - f(from_vector<double>(m, base.shape()))) /
           (2 * h);
  }
  return from_vector<double>(g, base.shape());
}

/** max |a - b| over all elements. */
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = x.size() == y.size() ? 0.0 : 1e300;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

}  // namespace quanta::testing
