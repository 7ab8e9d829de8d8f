// Every bitsandbytes NF4 reference case must pass bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "quant/parity/parity.h"
#include "support/test_data.h"

namespace fs = std::filesystem;
using namespace quanta;

namespace {
std::vector<std::string> nf4_case_paths() {
  std::vector<std::string> out;
  for (const auto& e :
       fs::directory_iterator(fs::path(quanta::testing::test_data("reference-vectors")))) {
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

TEST_CASE("nf4 parity: a spec that disagrees with the runner or the file fails, naming the key") {
  const auto paths = nf4_case_paths();
  REQUIRE(!paths.empty());
  const parity::CaseFile base = parity::load_case(paths.front());
  const std::string spec = base.metadata.at("spec");
  // Replaces the first `"key": value` in the spec with `"key": replacement`.
  auto with = [&](const std::string& key, const std::string& replacement) {
    parity::CaseFile c = base;
    std::string& s = c.metadata.at("spec");
    const std::string tag = "\"" + key + "\": ";
    const auto at = s.find(tag);
    REQUIRE(at != std::string::npos);
    const auto begin = at + tag.size();
    const auto end = s[begin] == '[' ? s.find(']', begin) + 1 : s.find_first_of(",}", begin);
    s.replace(begin, end - begin, replacement);
    return c;
  };
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"shape", "[-3, 37]"},
      {"blocksize", "0"},
      {"blocksize", "7"},
      {"blocksize", "1099511627776"},
      {"numel", "4611686018427387904"},
      {"compress_statistics", "true"},
  };
  for (const auto& [key, value] : bad) {
    CAPTURE(key);
    CAPTURE(value);
    const parity::CaseResult r = parity::run_case(with(key, value));
    CHECK_FALSE(r.passed());
    CHECK(r.error.find("spec." + key) != std::string::npos);
  }
  CHECK(parity::run_case(base).passed());
}
