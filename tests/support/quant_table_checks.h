#pragma once
// What the quantizer-table tests share: the CPU table, seeded inputs, and
// the error measure device results are held to.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "quant/kernels/table.h"
#include "quanta.h"

namespace quanta::testing {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

inline const quant::QuantKernelTable& cpu_quant_table() { return quant::quant_cpu::table(); }

/** Normal values from `seed`, in dtype `t`. */
inline Tensor random_tensor(const Shape& s, DType t, uint64_t seed) {
  Generator gen(seed);
  return randn(s, gen).to(t);
}

/** max |got - want| / max(1, max |want|), NaN-aware (NaN matches NaN);
 * either side may be on a device. */
inline double max_err(const Tensor& got, const Tensor& want) {
  const auto a = got.to(Device::cpu()).to(DType::f64).to_vector<double>();
  const auto b = want.to(Device::cpu()).to(DType::f64).to_vector<double>();
  REQUIRE(a.size() == b.size());
  double scale = 1, err = 0;
  for (double v : b) scale = std::max(scale, std::isfinite(v) ? std::fabs(v) : 0.0);
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    err = std::max(err, std::isnan(a[i] - b[i]) ? kInf : std::fabs(a[i] - b[i]));
  }
  return err / scale;
}

}  // namespace quanta::testing
