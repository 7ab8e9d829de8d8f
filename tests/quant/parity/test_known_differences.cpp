// Known differences (quant/parity/known_differences.cpp): with the EMA update
// on, the reference's gradient through the distances reads the post-update
// codebook. The case reports it by name and passes; nothing else is excused.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

#include "quant/parity/parity.h"
#include "quanta.h"

using namespace quanta;

namespace {

parity::CaseFile diversity_case() {
  const char* root = std::getenv("QUANTA_TEST_DATA");
  REQUIRE_MESSAGE(root != nullptr, "QUANTA_TEST_DATA is not set");
  return parity::load_case(
      (std::filesystem::path(root) / "reference-vectors" / "vq_diversity_ema.safetensors")
          .string());
}

const parity::TensorCheck& check_named(const parity::CaseResult& r, const std::string& name) {
  for (const auto& c : r.checks)
    if (c.name == name) return c;
  FAIL("no check '" << name << "'");
  return r.checks.front();
}

std::string report(const parity::CaseResult& r) {
  std::ostringstream out;
  parity::print_result(out, r);
  return out.str();
}

}  // namespace

TEST_CASE("diversity loss with the EMA update: x_grad is a named known difference") {
  const parity::CaseResult r = parity::run_case(diversity_case());
  const std::string text = report(r);
  INFO(text);
  CHECK(r.passed());
  const auto& g = check_named(r, "x_grad");
  CHECK_FALSE(g.pass);
  CHECK(g.ok());
  CHECK(g.known_difference.rfind("ema-distance-gradient: ", 0) == 0);
  REQUIRE(r.known_differences().size() == 1);
  CHECK(r.known_differences()[0] == "ema-distance-gradient");
  // Forward values, losses and the EMA state after the step all match.
  for (const auto& c : r.checks)
    if (c.name != "x_grad") CHECK_MESSAGE(c.pass, c.name);
  CHECK(text.find("vq_diversity_ema (VectorQuantize): PASS (known difference: "
                  "ema-distance-gradient)") != std::string::npos);
  CHECK(text.find("KNOWN DIFFERENCE (ema-distance-gradient: ") != std::string::npos);
}

TEST_CASE("a known difference does not excuse the forward values") {
  parity::CaseFile c = diversity_case();
  c.tensors["quantized"] = c.at("quantized") + 1e-2;
  const parity::CaseResult r = parity::run_case(c);
  CHECK_FALSE(r.passed());
  CHECK_FALSE(check_named(r, "quantized").ok());
  CHECK(check_named(r, "x_grad").ok());
  CHECK(report(r).find("): FAIL (known difference: ema-distance-gradient)") != std::string::npos);
}

TEST_CASE("without the EMA update the same x_grad mismatch is a plain failure") {
  parity::CaseFile c = diversity_case();
  std::string& spec = c.metadata.at("spec");
  const std::string key = "\"constructor_options\": {";
  const auto at = spec.find(key);
  REQUIRE(at != std::string::npos);
  spec.insert(at + key.size(), "\"ema_update\": false, ");
  const parity::CaseResult r = parity::run_case(c);
  CHECK_FALSE(r.passed());
  CHECK(r.known_differences().empty());
  CHECK(check_named(r, "x_grad").known_difference.empty());
}
