// Dispatch by class, comparison and the report shared by `quanta parity` and
// the parity tests.
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <ostream>
#include <sstream>

#include "engine/ops/view.h"
#include "quant/parity/parity.h"

namespace quanta::parity {

bool CaseResult::passed() const {
  return error.empty() && !checks.empty() &&
         std::all_of(checks.begin(), checks.end(), [](const TensorCheck& c) { return c.pass; });
}

TensorCheck compare(const std::string& name, const Tensor& actual, const Tensor& expected,
                    double tolerance) {
  TensorCheck c{name, std::numeric_limits<double>::infinity(), tolerance, false, ""};
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

CaseResult run_case(const CaseFile& c, double tolerance) {
  CaseResult r;
  r.case_name = c.name;
  auto cls = c.metadata.find("class");
  r.cls = cls == c.metadata.end() ? "" : cls->second;
  try {
    if (r.cls == "VectorQuantize" || r.cls == "ResidualVQ" || r.cls == "GroupedResidualVQ")
      run_vq_case(c, tolerance, r);
    else if (r.cls == "FSQ" || r.cls == "ResidualFSQ" || r.cls == "LFQ" || r.cls == "ResidualLFQ")
      run_scalar_case(c, tolerance, r);
    else if (r.cls == "bitsandbytes NF4")
      run_nf4_case(c, tolerance, r);
    else
      throw UnsupportedCase("class '" + r.cls + "' is not a class quanta can build");
    if (r.checks.empty()) r.error = "the runner compared nothing";
  } catch (const UnsupportedCase& e) {
    r.error = std::string("unsupported: ") + e.what();
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

void print_result(std::ostream& out, const CaseResult& r) {
  out << r.case_name << " (" << (r.cls.empty() ? "?" : r.cls) << "): "
      << (r.passed() ? "PASS" : "FAIL") << "\n";
  if (!r.error.empty()) out << "  error: " << r.error << "\n";
  for (const TensorCheck& c : r.checks) {
    out << "  " << std::left << std::setw(36) << c.name << " max_rel_err " << std::scientific
        << std::setprecision(2) << c.max_rel_error << " (tol " << c.tolerance << ") "
        << std::defaultfloat << (c.pass ? "PASS" : "FAIL");
    if (!c.detail.empty()) out << "  " << c.detail;
    out << "\n";
  }
}

}  // namespace quanta::parity
