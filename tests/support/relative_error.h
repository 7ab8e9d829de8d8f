#pragma once
// The error of a tensor against a reference, relative to the reference's
// scale: what tests of rounded arithmetic (bf16, TF32, other summation
// orders) compare.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/device.h"
#include "engine/tensor.h"

namespace quanta::testing {

/** max |a - b| / max |b| (both read as f64): the error relative to the
 * reference's scale, so that elements near zero do not dominate. */
inline double max_rel_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> x = a.to(Device::cpu()).to_vector<double>();
  const std::vector<double> y = b.to(Device::cpu()).to_vector<double>();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

/** max |t| (read as f64); 0 for an empty tensor. */
inline double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to(Device::cpu()).to_vector<double>()) m = std::max(m, std::abs(v));
  return m;
}

}  // namespace quanta::testing
