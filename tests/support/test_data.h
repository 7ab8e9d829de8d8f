#pragma once
// Where the checked-in fixtures are: one lookup of QUANTA_TEST_DATA for every
// test that reads them, so a missing variable fails the same way everywhere.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

namespace quanta::testing {

/** The checked-in fixtures folder (tests/data, which `meson test` names in
 * QUANTA_TEST_DATA), or `relative` inside it; a failed REQUIRE naming the
 * variable when it is not set. */
inline std::string test_data(const std::string& relative = "") {
  const char* root = std::getenv("QUANTA_TEST_DATA");
  REQUIRE_MESSAGE(root != nullptr, "QUANTA_TEST_DATA is not set (meson test sets it)");
  return relative.empty() ? std::string(root) : std::string(root) + "/" + relative;
}

}  // namespace quanta::testing
