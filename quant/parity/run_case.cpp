// Dispatch by class, comparison and the report shared by `quanta parity` and
// the parity tests.
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "engine/ops/view.h"
#include "quant/parity/parity.h"

namespace quanta::parity {

bool CaseResult::passed() const {
  return error.empty() && !checks.empty() &&
         std::all_of(checks.begin(), checks.end(), [](const TensorCheck& c) { return c.ok(); });
}

std::vector<std::string> CaseResult::known_differences() const {
  std::vector<std::string> names;
  for (const TensorCheck& c : checks) {
    if (c.pass || c.known_difference.empty()) continue;
    const std::string name = c.known_difference.substr(0, c.known_difference.find(':'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

TensorCheck compare(const std::string& name, const Tensor& actual, const Tensor& expected,
                    double tolerance) {
  TensorCheck c;
  c.name = name;
  c.max_rel_error = std::numeric_limits<double>::infinity();
  c.tolerance = tolerance;
  if (actual.shape() != expected.shape()) {
    c.detail = "shape " + shape_str(actual.shape()) + ", expected " + shape_str(expected.shape());
    return c;
  }
  const bool exact = !is_floating(expected.dtype());
  if (exact && is_floating(actual.dtype())) {
    c.detail = std::string("dtype ") + dtype_name(actual.dtype()) + ", expected " +
               dtype_name(expected.dtype());
    return c;
  }
  // Everything in f64 on the CPU: values of any stored dtype compare exactly.
  const Tensor a = contiguous(to_dtype(actual.detach().to(Device::cpu()), DType::f64));
  const Tensor e = contiguous(to_dtype(expected.detach().to(Device::cpu()), DType::f64));
  const double* pa = a.data<double>();
  const double* pe = e.data<double>();
  const int64_t n = a.numel();
  if (exact) {
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < n; ++i)
      if (pa[i] != pe[i] && wrong++ == 0) first = i;
    c.max_rel_error = n == 0 ? 0.0 : double(wrong) / double(n);
    c.pass = wrong == 0;
    if (wrong) {
      std::ostringstream d;
      d << wrong << " of " << n << " differ; first at flat index " << first << ": " << pa[first]
        << " vs " << pe[first];
      c.detail = d.str();
    }
    return c;
  }
  double scale = 0, err = 0;
  int64_t worst = -1;
  for (int64_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::abs(pe[i]));
    const double d = std::abs(pa[i] - pe[i]);
    // NaN anywhere in actual or expected is a failure unless both are NaN.
    const bool both_nan = std::isnan(pa[i]) && std::isnan(pe[i]);
    if (!both_nan && (std::isnan(d) || d > err)) {
      err = std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
      worst = i;
    }
  }
  c.max_rel_error = scale > 0 ? err / scale : err;
  c.pass = c.max_rel_error <= tolerance;
  if (!c.pass && worst >= 0) {
    std::ostringstream d;
    d << "worst at flat index " << worst << ": " << pa[worst] << " vs " << pe[worst];
    c.detail = d.str();
  }
  return c;
}

namespace {

// Every case carries its whole description in the metadata "spec" (a JSON
// object whose "case", "kind" and "class" repeat the top-level keys). A file
// without it, or with it damaged, is no reference case, even where a runner
// needs nothing more from it (NF4 reads only tensors).
void check_spec(const CaseFile& c) {
  nlohmann::json spec;
  try {
    spec = nlohmann::json::parse(c.meta("spec"));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(c.path + ": the case's 'spec' is not valid JSON (" + e.what() + ")");
  }
  if (!spec.is_object())
    throw std::runtime_error(c.path + ": the case's 'spec' must be a JSON object, got " +
                             std::string(spec.type_name()));
  for (const char* key : {"case", "kind", "class"}) {
    auto top = c.metadata.find(key);
    if (!spec.contains(key) || top == c.metadata.end()) continue;
    if (!spec[key].is_string() || spec[key].get<std::string>() != top->second)
      throw std::runtime_error(c.path + ": spec." + key + " is " + spec[key].dump() +
                               ", the case's metadata says \"" + top->second + "\"");
  }
  if (!spec.contains("kind"))
    throw std::runtime_error(c.path + ": the case's 'spec' has no \"kind\"");
}

}  // namespace

CaseResult run_case(const CaseFile& c, double tolerance) {
  CaseResult r;
  r.case_name = c.name;
  auto cls = c.metadata.find("class");
  r.cls = cls == c.metadata.end() ? "" : cls->second;
  const bool vq = r.cls == "VectorQuantize" || r.cls == "ResidualVQ" ||
                  r.cls == "GroupedResidualVQ" || r.cls == "HierarchicalVQ";
  const bool scalar = r.cls == "FSQ" || r.cls == "ResidualFSQ" || r.cls == "LFQ" ||
                      r.cls == "ResidualLFQ" || r.cls == "LatentQuantize" || r.cls == "FSP";
  const bool nf4 = r.cls == "bitsandbytes NF4";
  try {
    if (!vq && !scalar && !nf4)
      throw UnsupportedCase("class '" + r.cls + "' is not a class quanta can build");
    check_spec(c);
    if (vq)
      run_vq_case(c, tolerance, r);
    else if (scalar)
      run_scalar_case(c, tolerance, r);
    else
      run_nf4_case(c, tolerance, r);
    if (r.checks.empty()) r.error = "the runner compared nothing";
    apply_tolerance_rules(c, tolerance, r);
    mark_known_differences(c, r);
  } catch (const UnsupportedCase& e) {
    r.error = std::string("unsupported: ") + e.what();
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

void print_result(std::ostream& out, const CaseResult& r) {
  out << r.case_name << " (" << (r.cls.empty() ? "?" : r.cls)
      << "): " << (r.passed() ? "PASS" : "FAIL");
  const std::vector<std::string> known = r.known_differences();
  for (size_t i = 0; i < known.size(); ++i)
    out << (i == 0 ? " (known difference: " : ", ") << known[i];
  out << (known.empty() ? "\n" : ")\n");
  if (!r.error.empty()) out << "  error: " << r.error << "\n";
  for (size_t i = 0; i < r.replayed_draws.size(); ++i)
    out << (i == 0 ? "  replays the reference's draws: " : ", ") << r.replayed_draws[i]
        << (i + 1 == r.replayed_draws.size() ? "\n" : "");
  for (const TensorCheck& c : r.checks) {
    out << "  " << std::left << std::setw(36) << c.name << " max_rel_err " << std::scientific
        << std::setprecision(2) << c.max_rel_error << " (tol " << c.tolerance;
    if (!c.tolerance_rule.empty()) out << " " << c.tolerance_rule;
    out << ") " << std::defaultfloat;
    if (c.pass)
      out << "PASS";
    else if (!c.known_difference.empty())
      out << "KNOWN DIFFERENCE (" << c.known_difference << ")";
    else
      out << "FAIL";
    if (!c.detail.empty()) out << "  " << c.detail;
    out << "\n";
  }
}

}  // namespace quanta::parity
