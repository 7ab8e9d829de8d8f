// The parity runner's comparison rules and its handling of bad cases.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "quant/parity/parity.h"
#include "quanta.h"

using namespace quanta;
using parity::compare;

TEST_CASE("compare measures error relative to the largest expected magnitude") {
  const Tensor e = from_vector<float>({10.0f, 0.0f, -2.0f}, {3});
  const Tensor a = from_vector<float>({10.0f, 1e-4f, -2.0f}, {3});
  const auto c = compare("q", a, e, 1e-5);
  CHECK(c.max_rel_error == doctest::Approx(1e-5).epsilon(1e-3));
  CHECK(compare("q", a, e, 2e-5).pass);
  CHECK_FALSE(compare("q", a, e, 5e-6).pass);
  CHECK(compare("q", e, e, 0.0).pass);
}

TEST_CASE("compare: integers exactly, shapes and NaN are failures") {
  const Tensor i = from_vector<int64_t>({1, 2, 3, 4}, {4});
  const auto ok = compare("idx", from_vector<int32_t>({1, 2, 3, 4}, {4}), i, 1.0);
  CHECK(ok.pass);
  const auto bad = compare("idx", from_vector<int64_t>({1, 2, 0, 4}, {4}), i, 1.0);
  CHECK_FALSE(bad.pass);
  CHECK(bad.max_rel_error == doctest::Approx(0.25));
  CHECK(bad.detail.find("flat index 2") != std::string::npos);
  const auto shape = compare("idx", from_vector<int64_t>({1, 2, 3, 4}, {2, 2}), i, 1.0);
  CHECK_FALSE(shape.pass);
  CHECK(shape.detail.find("shape") != std::string::npos);
  const Tensor f = from_vector<float>({1.0f, 2.0f}, {2});
  CHECK_FALSE(compare("x", from_vector<float>({1.0f, NAN}, {2}), f, 1.0).pass);
  CHECK(compare("x", from_vector<float>({NAN}, {1}), from_vector<float>({NAN}, {1}), 0.0).pass);
  // A float result where the reference stored integers is a dtype mismatch.
  CHECK_FALSE(compare("idx", to_dtype(i, DType::f32), i, 1.0).pass);
  // Zero-size tensors compare equal.
  CHECK(compare("e", zeros({0, 3}), zeros({0, 3}), 0.0).pass);
}

TEST_CASE("run_case reports an unknown class without throwing") {
  parity::CaseFile c;
  c.path = "made-up.safetensors";
  c.name = "made_up";
  c.metadata["class"] = "MysteryQuantizer";
  const auto r = parity::run_case(c);
  CHECK_FALSE(r.passed());
  CHECK(r.error.find("MysteryQuantizer") != std::string::npos);
  std::ostringstream out;
  parity::print_result(out, r);
  CHECK(out.str().find("made_up (MysteryQuantizer): FAIL") != std::string::npos);
}

TEST_CASE("load_case names the file it cannot read") {
  CHECK_THROWS_WITH_AS(parity::load_case("/nonexistent/case.safetensors"),
                       doctest::Contains("/nonexistent/case.safetensors"), std::exception);
}
