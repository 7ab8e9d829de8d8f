// Every VectorQuantize-family reference case (vq_*, rvq_*, grvq_*,
// lookup_vq*, lookup_rvq*) through the shared parity runner.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "quant/parity/parity.h"
#include "support/test_data.h"

namespace fs = std::filesystem;
using namespace quanta;

namespace {

std::vector<fs::path> vq_cases() {
  std::vector<fs::path> files;
  for (const auto& e :
       fs::directory_iterator(fs::path(quanta::testing::test_data("reference-vectors")))) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".safetensors") continue;
    for (const char* prefix : {"vq_", "rvq_", "grvq_", "hvq_", "lookup_vq", "lookup_rvq"})
      if (name.rfind(prefix, 0) == 0) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

// Passing includes vq_diversity_ema, whose x_grad is a named known difference
// (test_known_differences.cpp).
TEST_CASE("every VQ-family reference case passes at base tolerance 1e-5") {
  const auto files = vq_cases();
  CHECK(files.size() >= 14);
  for (const auto& f : files) {
    const parity::CaseResult r = parity::run_case(parity::load_case(f.string()), 1e-5);
    std::ostringstream report;
    parity::print_result(report, r);
    INFO(report.str());
    CHECK(r.passed());
  }
}

TEST_CASE("an option quanta cannot build is reported by name") {
  const auto files = vq_cases();
  REQUIRE(!files.empty());
  parity::CaseFile c = parity::load_case(files.front().string());
  // Turn on an option quanta does not implement.
  std::string& spec = c.metadata.at("spec");
  const std::string key = "\"constructor_options\": {";
  const auto at = spec.find(key);
  REQUIRE(at != std::string::npos);
  spec.insert(at + key.size(), "\"in_place_codebook_optimizer\": \"Adam\", ");
  const parity::CaseResult r = parity::run_case(c, 1e-5);
  CHECK_FALSE(r.passed());
  CHECK(r.error.find("unsupported") != std::string::npos);
  CHECK(r.error.find("in_place_codebook_optimizer") != std::string::npos);
}
