// The per-term tolerances: the one table of tensors whose reference values
// carry more float32 rounding than the base tolerance allows, following
// tests/data/reference-vectors/README.md ("Precision and decision margins":
// about 1e-5 relative, 1e-4 for entropy terms and for gradients through the
// rotation trick). A rule scales the base tolerance, so `--tolerance` tightens
// or loosens every term together.
#include <nlohmann/json.hpp>
#include <string>

#include "quant/parity/parity.h"

namespace quanta::parity {
namespace {

using json = nlohmann::json;

// What a rule needs to know about the case besides the tensor's name.
struct CaseInfo {
  std::string cls, mode;
  json spec;
};

CaseInfo info_of(const CaseFile& c) {
  CaseInfo i;
  auto get = [&](const char* key) {
    auto it = c.metadata.find(key);
    return it == c.metadata.end() ? std::string() : it->second;
  };
  i.cls = get("class");
  i.mode = get("mode");
  // run_case has already refused a case without a valid spec; a hand-made
  // CaseFile without one simply matches no spec-dependent rule.
  i.spec = json::parse(get("spec"), nullptr, false);
  if (!i.spec.is_object()) i.spec = json::object();
  if (i.mode.empty()) i.mode = i.spec.value("mode", "");
  return i;
}

bool is_vq_family(const std::string& cls) {
  return cls == "VectorQuantize" || cls == "ResidualVQ" || cls == "GroupedResidualVQ";
}

// The reference's own resolution when the case records it, else the option as
// passed, else the reference's default (rotation_trick defaults to true
// unless DiVeQ routes the gradient, and no route is taken without
// route_gradients_to_input).
bool rotation_trick_on(const CaseInfo& i) {
  const json resolved = i.spec.value("resolved", json::object());
  if (resolved.contains("rotation_trick") && resolved["rotation_trick"].is_boolean())
    return resolved["rotation_trick"].get<bool>();
  const json opts = i.spec.value("constructor_options", json::object());
  if (opts.contains("rotation_trick") && opts["rotation_trick"].is_boolean())
    return opts["rotation_trick"].get<bool>();
  return opts.value("directional_reparam", false) != true && opts.value("diveq", false) != true &&
         opts.value("route_gradients_to_input", true) != false;
}

bool entropy_term(const std::string& name, const CaseInfo&) {
  return name == "aux_loss.per_sample_entropy" || name == "aux_loss.batch_entropy";
}

bool rotation_trick_gradient(const std::string& name, const CaseInfo& i) {
  return name.ends_with("_grad") && is_vq_family(i.cls) && i.mode == "train" &&
         rotation_trick_on(i);
}

struct Row {
  ToleranceRule rule;
  bool (*covers)(const std::string& name, const CaseInfo& i);
};

// The table. The first row that covers a tensor sets its tolerance.
const Row kRows[] = {
    {{"entropy", 10.0,
      "per_sample_entropy and batch_entropy sum p log p over every code of the codebook; "
      "float32 rounding of those sums reaches ~1e-5 of the value"},
     entropy_term},
    {{"rotation-trick", 10.0,
      "gradients through the rotation trick pass through two normalisations and a "
      "reflection, each rounded in float32"},
     rotation_trick_gradient},
};

}  // namespace

const ToleranceRule* tolerance_rule(const CaseFile& c, const std::string& name) {
  const CaseInfo i = info_of(c);
  for (const Row& row : kRows)
    if (row.covers(name, i)) return &row.rule;
  return nullptr;
}

void apply_tolerance_rules(const CaseFile& c, double base, CaseResult& r) {
  for (TensorCheck& check : r.checks) {
    // A runner that chose its own tolerance (NF4's exact values) keeps it.
    if (check.tolerance != base) continue;
    const ToleranceRule* rule = tolerance_rule(c, check.name);
    if (rule == nullptr) continue;
    check.tolerance = base * rule->factor;
    check.tolerance_rule = rule->name;
    check.pass = check.max_rel_error <= check.tolerance;
    if (check.pass) check.detail.clear();
  }
}

}  // namespace quanta::parity
