#pragma once
// Helpers for the scalar quantizer tests: values as vectors, maximum
// differences, and f64 central-difference gradients.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "quanta.h"
#include "support/numeric_grad.h"

namespace scalar_test {

using namespace quanta;

inline std::vector<double> vals(const Tensor& t) { return t.detach().to_vector<double>(); }

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const auto va = vals(a), vb = vals(b);
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) m = std::max(m, std::abs(va[i] - vb[i]));
  return m;
}

inline double max_abs(const Tensor& a) {
  double m = 0;
  for (double v : vals(a)) m = std::max(m, std::abs(v));
  return m;
}

using quanta::testing::numeric_grad;

/** Relative error of `actual` against `expected`, scaled by max |expected|. */
inline double rel_err(const Tensor& actual, const Tensor& expected) {
  const double scale = std::max(max_abs(expected), 1e-12);
  return max_abs_diff(actual, expected) / scale;
}

}  // namespace scalar_test
