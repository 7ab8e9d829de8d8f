// `quanta parity` through the real binary (QUANTA_EXE): per-term tolerances
// named in the output, --tolerance as the base that scales them, and a known
// difference reported by name without failing the run (text and --json).
#include <doctest/doctest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "cli_runner.h"
#include "support/test_data.h"

using quanta::test::contains;
using quanta::test::run_quanta;

namespace {

std::string reference(const std::string& name) {
  return quanta::testing::test_data("reference-vectors/" + name + ".safetensors");
}

// `name` by value: a reference parameter bound to a temporary string makes
// g++ 13 warn that the returned reference may dangle.
const nlohmann::json& check_named(const nlohmann::json& c, std::string_view name) {
  for (const auto& check : c.at("checks"))
    if (check.at("name").get<std::string>() == name) return check;
  FAIL("no check '" << name << "'");
  return c;
}

}  // namespace

TEST_CASE("parity: the entropy terms' tolerance is shown with its rule") {
  const auto r = run_quanta({"parity", reference("lfq_d10_c1024_entropy_commit")});
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK(contains(r.out, "aux_loss.per_sample_entropy"));
  CHECK(contains(r.out, "(tol 1.00e-04 entropy) PASS"));
  CHECK(contains(r.out, "1 of 1 cases passed\n"));
}

TEST_CASE("parity: --tolerance is the base, and tightening it tightens every term") {
  const auto r =
      run_quanta({"parity", reference("lfq_d10_c1024_entropy_commit"), "--tolerance", "1e-6"});
  INFO(r.out << r.err);
  CHECK(r.code == 1);
  CHECK(contains(r.out, "(tol 1.00e-05 entropy) FAIL"));
  CHECK(contains(r.out, "0 of 1 cases passed"));
}

TEST_CASE("parity: a known difference is named and does not fail the run") {
  const auto r = run_quanta({"parity", reference("vq_diversity_ema")});
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK(contains(r.out,
                 "vq_diversity_ema (VectorQuantize): PASS (known difference: "
                 "ema-distance-gradient)"));
  CHECK(contains(r.out, "KNOWN DIFFERENCE (ema-distance-gradient: "));
  CHECK_FALSE(contains(r.out, " FAIL"));
  CHECK(contains(r.out, "1 of 1 cases passed (1 with known differences)"));
}

TEST_CASE("parity --json: statuses, tolerance rules and known differences") {
  const auto r = run_quanta({"parity", "--json", reference("vq_diversity_ema"),
                             reference("lfq_d10_c1024_entropy_commit")});
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  const nlohmann::json all = nlohmann::json::parse(r.out);
  REQUIRE(all.size() == 2);
  const nlohmann::json& vq = all[0];
  CHECK(vq.at("passed") == true);
  CHECK(vq.at("known_differences") == nlohmann::json::array({"ema-distance-gradient"}));
  const nlohmann::json& g = check_named(vq, "x_grad");
  CHECK(g.at("status") == "KNOWN DIFFERENCE");
  CHECK(g.at("pass") == false);
  CHECK(g.at("known_difference").get<std::string>().rfind("ema-distance-gradient: ", 0) == 0);
  CHECK(check_named(vq, "quantized").at("status") == "PASS");
  const nlohmann::json& lfq = all[1];
  CHECK(lfq.at("known_differences").empty());
  const nlohmann::json& e = check_named(lfq, "aux_loss.per_sample_entropy");
  CHECK(e.at("status") == "PASS");
  CHECK(e.at("tolerance_rule") == "entropy");
  CHECK(e.at("tolerance").get<double>() == doctest::Approx(1e-4));
  CHECK_FALSE(check_named(lfq, "quantized").contains("tolerance_rule"));
}
