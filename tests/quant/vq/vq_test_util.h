#pragma once
// Helpers shared by the quant_vq tests.
#include <functional>
#include <vector>

#include "quanta.h"
#include "support/numeric_grad.h"

namespace quanta::testing {

/** max |a - b| over all elements. */
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = x.size() == y.size() ? 0.0 : 1e300;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

}  // namespace quanta::testing
