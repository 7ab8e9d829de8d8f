// Known differences (quant/parity/known_differences.cpp): with the EMA update
// on, the reference's gradient through the distances reads the post-update
// codebook; after a beam search the reference updates only layer 0. Each case
// reports its difference by name and passes; nothing else is excused. And the
// DiVeQ cases replay the reference's recorded noise.
#include <doctest/doctest.h>

#include <string>

#include "parity_test_util.h"
#include "quant/parity/parity.h"
#include "quanta.h"

using namespace quanta;

namespace {

using parity::testing::check_named;
using parity::testing::report;

parity::CaseFile diversity_case() { return parity::testing::reference_case("vq_diversity_ema"); }

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

TEST_CASE(
    "beam search in training: later layers' state is a named known difference, layer 0's "
    "matches") {
  const parity::CaseResult r = parity::run_case(parity::testing::reference_case("rvq_q3_beam2"));
  const std::string text = report(r);
  INFO(text);
  CHECK(r.passed());
  REQUIRE(r.known_differences().size() == 1);
  CHECK(r.known_differences()[0] == "beam-search-updates-layer-0");
  for (const auto& c : r.checks) {
    const bool later_state = c.name.ends_with("_after") && c.name.rfind("layers.0.", 0) != 0;
    if (later_state && !c.pass)
      CHECK(c.known_difference.rfind("beam-search-updates-layer-0: ", 0) == 0);
    if (!later_state) CHECK_MESSAGE(c.pass, c.name);  // forward, losses, gradients, layer 0
  }
  CHECK_FALSE(check_named(r, "layers.1._codebook.embed_after").pass);
}

TEST_CASE("DiVeQ cases replay the reference's noise and say so") {
  const parity::CaseResult r = parity::run_case(parity::testing::reference_case("vq_diveq"));
  INFO(report(r));
  CHECK(r.passed());
  REQUIRE(r.replayed_draws.size() == 1);
  CHECK(r.replayed_draws[0] == "directional_noise");
  CHECK(report(r).find("replays the reference's draws: directional_noise") != std::string::npos);
  // Without the recorded draw the layer draws its own noise: the output differs.
  parity::CaseFile own = parity::testing::reference_case("vq_diveq");
  own.tensors.erase("draws.directional_noise");
  CHECK_FALSE(parity::run_case(own).passed());
}
