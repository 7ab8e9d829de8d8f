#pragma once
// Parity with the reference implementations. A case file is a safetensors
// file dumped from vector-quantize-pytorch or bitsandbytes (format:
// tests/data/reference-vectors/README.md): its metadata describes the layer
// and the call, its tensors hold the state, inputs and expected results. A
// runner rebuilds the quanta layer, makes the same call and compares every
// stored result. `quanta parity` and the parity tests both call run_case.
#include <iosfwd>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace quanta::parity {

/** A case the runners cannot build: an option, class or call quanta lacks.
 * The message names it. */
struct UnsupportedCase : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** A loaded case file. */
struct CaseFile {
  std::string path;
  /** metadata "case", or the file name without extension. */
  std::string name;
  std::map<std::string, std::string> metadata;
  std::map<std::string, Tensor> tensors;

  bool has(const std::string& key) const { return tensors.count(key) != 0; }
  /** The tensor `key`; throws std::runtime_error naming the file and key. */
  const Tensor& at(const std::string& key) const;
  /** metadata[key]; throws std::runtime_error naming the file and key. */
  const std::string& meta(const std::string& key) const;
};

/** Loads `path`; errors name the file. */
CaseFile load_case(const std::string& path);

/** One compared tensor. */
struct TensorCheck {
  std::string name;
  /** Floating tensors: max |actual - expected| / max |expected| (the error
   * relative to the tensor's largest magnitude; the absolute error when every
   * expected value is 0). Integer and boolean tensors: the fraction of
   * elements that differ. Infinity on a shape or dtype mismatch. */
  double max_rel_error = 0;
  double tolerance = 0;
  bool pass = false;
  /** Why it failed beyond the number: shape mismatch, first differing index. */
  std::string detail;
  /** The short name of the tolerance rule that set `tolerance` ("entropy",
   * "rotation-trick"); empty when the base tolerance applied. */
  std::string tolerance_rule;
  /** Set on a failed check that a documented difference explains:
   * "<name>: <what differs>". Such a check does not fail its case. */
  std::string known_difference;
  /** Passed, or failed by a known difference. */
  bool ok() const { return pass || !known_difference.empty(); }
};

/** The result of one case. */
struct CaseResult {
  std::string case_name;
  /** metadata "class" (VectorQuantize, FSQ, bitsandbytes NF4, ...). */
  std::string cls;
  std::vector<TensorCheck> checks;
  /** Non-empty when the case could not be run: what is unsupported or broken. */
  std::string error;
  /** The reference's random draws inside the forward that the run replayed
   * from the case (tensors "draws.<name>") instead of drawing its own. */
  std::vector<std::string> replayed_draws;
  /** No error, at least one check, and every check passed or failed only by
   * a known difference. */
  bool passed() const;
  /** The names of the known differences among the checks (each once). */
  std::vector<std::string> known_differences() const;
};

/** Compares `actual` with `expected` (see TensorCheck). Integer and boolean
 * tensors must match exactly whatever `tolerance` is. */
TensorCheck compare(const std::string& name, const Tensor& actual, const Tensor& expected,
                    double tolerance);

/** Runs `c` with the runner its metadata "class" names; `tolerance` is the
 * base tolerance, which the per-term rules scale (tolerances.cpp). Never
 * throws for a bad or unsupported case: the result's error says what went
 * wrong. */
CaseResult run_case(const CaseFile& c, double tolerance = 1e-5);

/** One per-term tolerance: tensors it covers compare at `factor` times the
 * base tolerance. */
struct ToleranceRule {
  /** Short name printed beside the tolerance. */
  const char* name;
  double factor;
  /** Why the reference values carry more rounding there. */
  const char* why;
};

/** The rule for tensor `name` of case `c`, or nullptr for the base
 * tolerance (tolerances.cpp holds the table). */
const ToleranceRule* tolerance_rule(const CaseFile& c, const std::string& name);

/** Applies tolerance_rule to every check `r` holds at the base tolerance
 * `base`: widens its tolerance, names the rule and re-judges it. */
void apply_tolerance_rules(const CaseFile& c, double base, CaseResult& r);

/** Marks the failed checks of `r` that a documented difference between quanta
 * and the reference explains (known_differences.cpp, docs/vq.md). */
void mark_known_differences(const CaseFile& c, CaseResult& r);

/** Prints "case: PASS|FAIL" and one line per check (name, error, tolerance and
 * its rule, PASS / FAIL / KNOWN DIFFERENCE (name: ...)), or the error. */
void print_result(std::ostream& out, const CaseResult& r);

// ---- family runners: one file each; throw UnsupportedCase for what they
// cannot build. `r` arrives with case_name and cls filled in.
/** VectorQuantize, ResidualVQ, GroupedResidualVQ (vq_cases.cpp). */
void run_vq_case(const CaseFile& c, double tolerance, CaseResult& r);
/** FSQ, ResidualFSQ, LFQ, ResidualLFQ (scalar_cases.cpp). */
void run_scalar_case(const CaseFile& c, double tolerance, CaseResult& r);
/** bitsandbytes NF4 (nf4_cases.cpp). */
void run_nf4_case(const CaseFile& c, double tolerance, CaseResult& r);

}  // namespace quanta::parity
