// Every bitsandbytes NF4 reference case must pass bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "quant/parity/parity.h"

namespace fs = std::filesystem;
using namespace quanta;

namespace {
std::vector<std::string> nf4_case_paths() {
  const char* root = std::getenv("QUANTA_TEST_DATA");
  REQUIRE_MESSAGE(root != nullptr, "QUANTA_TEST_DATA is not set");
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fs::path(root) / "reference-vectors")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("nf4_", 0) == 0 && e.path().extension() == ".safetensors")
      out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

TEST_CASE("nf4 parity: every bitsandbytes reference case passes") {
  const auto paths = nf4_case_paths();
  REQUIRE(paths.size() >= 7);
  for (const auto& p : paths) {
    const parity::CaseResult r = parity::run_case(parity::load_case(p));
    std::ostringstream report;
    parity::print_result(report, r);
    INFO(report.str());
    CHECK(r.passed());
    CHECK(r.checks.size() >= 5);
  }
}
