#pragma once
// The fingerprint of one collective call: what debug mode exchanges before
// moving data, what the always-on check carries inside the payload (or, for
// reductions, its 32-bit check word) and what failure reports print. Fixed
// size, so exchanging it can never itself mismatch. Internal to dist.
#include <cstdint>
#include <source_location>
#include <string>
#include <vector>

#include "dist/process_group.h"

namespace quanta::dist::detail {

/** How ranks' shapes must relate for a collective to pair up. */
enum ShapeRule : int32_t {
  kSameShape = 0,    // every rank passes the same shape
  kAnyFirstDim = 1,  // dim 0 may differ (all_gather_v)
  kNoTensor = 2,     // barrier
};

struct Fingerprint {
  uint64_t seq = 0;
  int32_t op = 0;  // index into op_names()
  int32_t dtype = -1;
  int32_t ndim = 0;
  int32_t shape_rule = kSameShape;
  int32_t reduce = -1;  // ReduceOp or -1
  int32_t root = -1;
  int64_t shape[8] = {};  // dims beyond 8 are folded into shape_hash
  uint64_t shape_hash = 0;
  uint32_t line = 0;
  char file[60] = {};  // the call site's file name (last 59 characters)
};

/** The ops a fingerprint can name, in op-index order. */
int32_t op_index(const char* op);
/** A fingerprint of `op` on tensor `t` (null for barrier). */
Fingerprint make_fingerprint(const char* op, uint64_t seq, const Tensor* t, int32_t shape_rule,
                             int32_t reduce, int32_t root, const std::source_location& site);
/** "all_reduce #3 (f32 [4, 5], sum) at test.cpp:12". */
std::string describe(const Fingerprint& f);
/** A 32-bit tag that differs (almost surely) when the calls would not pair:
 * seq, op, dtype, shape (by rule), reduce op and root. Gloo slots are keyed
 * by it, so mismatched calls never exchange bytes (Gloo aborts on length
 * mismatches); they time out and are reported instead. */
uint32_t tag_of(const Fingerprint& f);
/** A 32-bit word of everything a call must agree on across ranks: what
 * tag_of covers plus the call site (line and file name), so that two calls
 * that would pair up but came from different lines differ too. The
 * always-on check carries it inside every reduction (reduce_check.h). */
uint32_t check_word(const Fingerprint& f);
/** Empty when every rank's fingerprint matches; else a report naming the
 * differing ranks and what differs (identical on every rank). `ranks[i]`
 * names the rank of `all[i]` (empty: all[i] is rank i). */
std::string compare(const std::vector<Fingerprint>& all, const std::vector<int>& ranks = {});

}  // namespace quanta::dist::detail
