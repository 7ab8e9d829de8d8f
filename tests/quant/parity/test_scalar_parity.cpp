// Every FSQ / ResidualFSQ / LFQ / ResidualLFQ reference case (forward +
// backward and lookups) through the same runner as `quanta parity`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "parity_test_util.h"
#include "quant/parity/parity.h"
#include "support/test_data.h"

namespace {

std::vector<std::string> scalar_cases() {
  std::vector<std::string> files;
  const std::filesystem::path dir(quanta::testing::test_data("reference-vectors"));
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".safetensors") continue;
    std::string family = name.rfind("lookup_", 0) == 0 ? name.substr(7) : name;
    for (const char* f : {"fsq_", "rfsq_", "lfq_", "rlfq_", "latent_", "fsp_"})
      if (family.rfind(f, 0) == 0) files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

TEST_CASE("scalar quantizer parity with vector-quantize-pytorch 1.31.0 and 1.32.0") {
  const std::vector<std::string> files = scalar_cases();
  // fsq x4, rfsq x1, lfq x5, rlfq x1 and their lookups (3 + 1 + 2 + 1);
  // LatentQuantize x2 and FSP x5 (1.32).
  CHECK(files.size() == 25);
  for (const std::string& path : files) {
    const quanta::parity::CaseResult r = quanta::parity::run_case(quanta::parity::load_case(path));
    std::ostringstream report;
    quanta::parity::print_result(report, r);
    INFO(report.str());
    if (std::getenv("QUANTA_PARITY_VERBOSE")) MESSAGE(report.str());
    CHECK(r.passed());
  }
}

TEST_CASE("scalar parity: a size of 0 or below in a case's options fails, naming the option") {
  using namespace quanta;
  const parity::CaseFile base = parity::testing::reference_case("lfq_c2x16");
  for (const std::string& option :
       {std::string("\"codebook_size\": 0"), std::string("\"codebook_size\": -4"),
        std::string("\"dim\": 0")}) {
    CAPTURE(option);
    parity::CaseFile c = base;
    std::string& spec = c.metadata.at("spec");
    const std::string key = "\"constructor_options\": {";
    const auto at = spec.find(key);
    REQUIRE(at != std::string::npos);
    // The case's own codebook_size goes, so the option given is the only one.
    const auto cs = spec.find("\"codebook_size\": 16", at);
    REQUIRE(cs != std::string::npos);
    spec.erase(cs, std::string("\"codebook_size\": 16, ").size());
    spec.insert(at + key.size(), option + ", ");
    const parity::CaseResult r = parity::run_case(c, 1e-5);
    CHECK_FALSE(r.passed());
    const std::string name = option.substr(1, option.find('"', 1) - 1);
    CHECK(r.error.find("LFQ option '" + name + "' must be a whole number >= 1") !=
          std::string::npos);
  }
}
