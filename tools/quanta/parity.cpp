// `quanta parity FILE|DIR...`: runs reference cases dumped from
// vector-quantize-pytorch or bitsandbytes (tests/data/reference-vectors/
// README.md) through the same runner as the parity tests, prints every
// compared tensor, and fails (exit 1) when any case fails or cannot be built.
// A known difference (docs/vq.md) is reported by name and does not fail.
#include "quant/parity/parity.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "flag_checks.h"

namespace quanta::cli {
namespace {

namespace fs = std::filesystem;

struct ParityOptions {
  std::vector<std::string> paths;
  double tolerance = 1e-5;
  bool json = false;
};

// Files named on the command line, and every *.safetensors of a directory
// (sorted, so runs are reproducible).
std::vector<std::string> expand(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const std::string& p : paths) {
    if (fs::is_directory(p)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(p))
        if (e.is_regular_file() && e.path().extension() == ".safetensors")
          found.push_back(e.path().string());
      if (found.empty()) throw UsageError("directory '" + p + "' holds no .safetensors files");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(p);
    }
  }
  return files;
}

nlohmann::ordered_json to_json(const std::string& file, const parity::CaseResult& r) {
  nlohmann::ordered_json j;
  j["file"] = file;
  j["case"] = r.case_name;
  j["class"] = r.cls;
  j["passed"] = r.passed();
  j["known_differences"] = r.known_differences();
  j["replayed_draws"] = r.replayed_draws;
  if (!r.error.empty()) j["error"] = r.error;
  j["checks"] = nlohmann::ordered_json::array();
  for (const auto& c : r.checks) {
    // "pass" is the comparison itself; "status" says how the run judges it.
    const char* status = c.pass ? "PASS" : c.ok() ? "KNOWN DIFFERENCE" : "FAIL";
    nlohmann::ordered_json cj{
        {"name", c.name}, {"status", status}, {"pass", c.pass}, {"tolerance", c.tolerance}};
    if (!c.tolerance_rule.empty()) cj["tolerance_rule"] = c.tolerance_rule;
    if (!c.known_difference.empty()) cj["known_difference"] = c.known_difference;
    // JSON has no infinity: a shape or dtype mismatch reports null.
    if (std::isfinite(c.max_rel_error))
      cj["max_rel_error"] = c.max_rel_error;
    else
      cj["max_rel_error"] = nullptr;
    if (!c.detail.empty()) cj["detail"] = c.detail;
    j["checks"].push_back(cj);
  }
  return j;
}

void run_parity(const ParityOptions& o) {
  const std::vector<std::string> files = expand(o.paths);
  int failed = 0, known = 0;
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const std::string& f : files) {
    parity::CaseResult r;
    try {
      r = parity::run_case(parity::load_case(f), o.tolerance);
    } catch (const std::exception& e) {  // an unreadable file is a failed case
      r.case_name = fs::path(f).stem().string();
      r.error = e.what();
    }
    if (!r.passed())
      ++failed;
    else if (!r.known_differences().empty())
      ++known;
    if (o.json)
      all.push_back(to_json(f, r));
    else
      parity::print_result(std::cout, r);
  }
  if (o.json) {
    std::cout << all.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << files.size() - failed << " of " << files.size() << " cases passed";
    if (known) std::cout << " (" << known << " with known differences)";
    std::cout << "\n";
  }
  std::cout.flush();
  if (failed)
    throw std::runtime_error("parity: " + std::to_string(failed) + " of " +
                             std::to_string(files.size()) + " cases failed");
}

}  // namespace

void add_parity(CLI::App& app) {
  auto o = std::make_shared<ParityOptions>();
  CLI::App* sub = app.add_subcommand(
      "parity",
      "Run reference cases (safetensors files dumped from vector-quantize-pytorch or "
      "bitsandbytes) and compare every stored tensor; exit 1 if any case fails");
  sub->footer(
      "Examples:\n"
      "  quanta parity tests/data/parity                 # every case in the folder\n"
      "  quanta parity case.safetensors --tolerance 1e-4 --json");
  sub->add_option("files", o->paths, "case files, or directories of them")->required();
  sub->add_option("--tolerance", o->tolerance,
                  "base max relative error of floating tensors (default 1e-5); the terms the "
                  "reference allows more (entropy terms, rotation-trick gradients: 10x) scale "
                  "with it")
      ->check(number_in(0, std::numeric_limits<double>::max()));
  sub->add_flag("--json", o->json, "print a JSON list of case results");
  sub->callback([o] { run_parity(*o); });
}

}  // namespace quanta::cli
