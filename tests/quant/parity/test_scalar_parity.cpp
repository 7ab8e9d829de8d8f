// Every FSQ / ResidualFSQ / LFQ / ResidualLFQ reference case (forward +
// backward and lookups) through the same runner as `quanta parity`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "quant/parity/parity.h"

namespace {

std::vector<std::string> scalar_cases() {
  const char* root = std::getenv("QUANTA_TEST_DATA");
  REQUIRE_MESSAGE(root != nullptr, "QUANTA_TEST_DATA is not set");
  std::vector<std::string> files;
  const std::filesystem::path dir = std::filesystem::path(root) / "reference-vectors";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".safetensors") continue;
    std::string family = name.rfind("lookup_", 0) == 0 ? name.substr(7) : name;
    for (const char* f : {"fsq_", "rfsq_", "lfq_", "rlfq_"})
      if (family.rfind(f, 0) == 0) files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

TEST_CASE("scalar quantizer parity with vector-quantize-pytorch 1.31.0") {
  const std::vector<std::string> files = scalar_cases();
  // fsq x4, rfsq x1, lfq x5, rlfq x1 and their lookups (3 + 1 + 2 + 1).
  CHECK(files.size() == 18);
  for (const std::string& path : files) {
    const quanta::parity::CaseResult r = quanta::parity::run_case(quanta::parity::load_case(path));
    std::ostringstream report;
    quanta::parity::print_result(report, r);
    INFO(report.str());
    if (std::getenv("QUANTA_PARITY_VERBOSE")) MESSAGE(report.str());
    CHECK(r.passed());
  }
}
