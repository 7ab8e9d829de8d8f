#pragma once
// ops.json (tests/data/llm/, made by make_op_fixtures.py with transformers
// and PyTorch): loaded once, tensors read back in any dtype.
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "quanta.h"
#include "support/relative_error.h"
#include "support/test_data.h"

namespace quanta::testing {

inline const nlohmann::json& op_fixtures() {
  static const nlohmann::json j = [] {
    const std::string path = test_data("llm/ops.json");
    std::ifstream in(path);
    REQUIRE_MESSAGE(in.good(), "cannot open " << path);
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

}  // namespace quanta::testing
