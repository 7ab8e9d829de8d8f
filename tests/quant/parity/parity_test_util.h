#pragma once
// What the parity tests share: a reference case by name, one check of a
// result by tensor name, and the printed report (for INFO on failure).
#include <doctest/doctest.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <string_view>

#include "quant/parity/parity.h"
#include "support/test_data.h"

namespace quanta::parity::testing {

/** tests/data/reference-vectors/<name>.safetensors. */
inline CaseFile reference_case(const std::string& name) {
  return load_case(quanta::testing::test_data("reference-vectors/" + name + ".safetensors"));
}

// `name` by value: a reference parameter bound to a temporary string makes
// g++ 13 warn that the returned reference may dangle.
inline const TensorCheck& check_named(const CaseResult& r, std::string_view name) {
  for (const auto& c : r.checks)
    if (c.name == name) return c;
  FAIL("no check '" << name << "'");
  return r.checks.front();
}

inline std::string report(const CaseResult& r) {
  std::ostringstream out;
  print_result(out, r);
  return out.str();
}

}  // namespace quanta::parity::testing
