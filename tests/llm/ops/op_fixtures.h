#pragma once
// ops.json (tests/data/llm/, made by make_op_fixtures.py with transformers
// and PyTorch): loaded once, tensors read back in any dtype.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "quanta.h"

namespace quanta::testing {

inline const nlohmann::json& op_fixtures() {
  static const nlohmann::json j = [] {
    const char* root = std::getenv("QUANTA_TEST_DATA");
    REQUIRE_MESSAGE(root != nullptr, "QUANTA_TEST_DATA is not set");
    std::ifstream in(std::string(root) + "/llm/ops.json");
    REQUIRE_MESSAGE(in.good(), "cannot open " << root << "/llm/ops.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

/** A fixture tensor ({"shape", "data"}) as `dtype` (values are f64, exact). */
inline Tensor fixture_tensor(const nlohmann::json& t, DType dtype = DType::f32) {
  const std::vector<double> data = t.at("data").get<std::vector<double>>();
  const Shape shape = t.at("shape").get<std::vector<int64_t>>();
  return from_vector<double>(data, shape).to(dtype);
}

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

}  // namespace quanta::testing
