// Per-term tolerances (quant/parity/tolerances.cpp): the entropy terms and
// rotation-trick gradients compare at 10x the base tolerance, the rule is named
// in the report, and a tighter base tightens them too.
#include <doctest/doctest.h>

#include <string>

#include "parity_test_util.h"
#include "quant/parity/parity.h"

using namespace quanta;

using parity::testing::check_named;
using parity::testing::reference_case;
using parity::testing::report;

// Float32 rounding of the entropy over 1024 codes puts the
// reference's per_sample_entropy ~5e-5 off the float64 value quanta matches.
TEST_CASE("LFQ with 1024 codes: the entropy terms compare at 1e-4 and pass") {
  const parity::CaseFile c = reference_case("lfq_d10_c1024_entropy_commit");
  const parity::CaseResult r = parity::run_case(c, 1e-5);
  INFO(report(r));
  CHECK(r.passed());
  const auto& entropy = check_named(r, "aux_loss.per_sample_entropy");
  CHECK(entropy.pass);
  CHECK(entropy.tolerance == doctest::Approx(1e-4));
  CHECK(entropy.tolerance_rule == "entropy");
  CHECK(entropy.max_rel_error > 1e-5);  // what failed under one tolerance
  CHECK(check_named(r, "aux_loss.batch_entropy").tolerance_rule == "entropy");
  // Everything else keeps the base tolerance and names no rule.
  const auto& commitment = check_named(r, "aux_loss.commitment");
  CHECK(commitment.tolerance == doctest::Approx(1e-5));
  CHECK(commitment.tolerance_rule.empty());
  CHECK(check_named(r, "x_grad").tolerance_rule.empty());
  const std::string text = report(r);
  CHECK(text.find("(tol 1.00e-04 entropy) PASS") != std::string::npos);
  CHECK(text.find("(tol 1.00e-05) PASS") != std::string::npos);
}

TEST_CASE("a tighter base tolerance tightens the per-term ones") {
  const parity::CaseResult r =
      parity::run_case(reference_case("lfq_d10_c1024_entropy_commit"), 1e-6);
  CHECK_FALSE(r.passed());
  const auto& entropy = check_named(r, "aux_loss.per_sample_entropy");
  CHECK(entropy.tolerance == doctest::Approx(1e-5));
  CHECK_FALSE(entropy.pass);
  CHECK(entropy.detail.find("worst at flat index") != std::string::npos);
}

TEST_CASE("rotation-trick gradients get their rule; straight-through ones do not") {
  const parity::CaseResult rot = parity::run_case(reference_case("vq_euclidean_rotation"));
  CHECK(rot.passed());
  CHECK(check_named(rot, "x_grad").tolerance_rule == "rotation-trick");
  CHECK(check_named(rot, "x_grad").tolerance == doctest::Approx(1e-4));
  CHECK(check_named(rot, "quantized").tolerance_rule.empty());
  const parity::CaseResult ste = parity::run_case(reference_case("vq_euclidean_ste"));
  CHECK(ste.passed());
  CHECK(check_named(ste, "x_grad").tolerance_rule.empty());
  CHECK(check_named(ste, "x_grad").tolerance == doctest::Approx(1e-5));
}

TEST_CASE("tolerance_rule names the rule and its reason") {
  const parity::CaseFile c = reference_case("lfq_d10_c1024_entropy_commit");
  const parity::ToleranceRule* rule = parity::tolerance_rule(c, "aux_loss.batch_entropy");
  REQUIRE(rule != nullptr);
  CHECK(std::string(rule->name) == "entropy");
  CHECK(rule->factor == doctest::Approx(10.0));
  CHECK(std::string(rule->why).find("entropy") != std::string::npos);
  CHECK(parity::tolerance_rule(c, "quantized") == nullptr);
  // NF4's exact comparisons keep their own tolerance whatever the base.
  const parity::CaseResult nf4 = parity::run_case(reference_case("nf4_bs64_64x64"), 1e-3);
  CHECK(nf4.passed());
  CHECK(check_named(nf4, "dequantized").tolerance == 0.0);
}
