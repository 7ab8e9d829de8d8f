#pragma once
// Whether the ranks made the same call, checked for ProcessGroup: in debug
// mode (QUANTA_DIST_DEBUG) by exchanging whole fingerprints before the data
// moves; otherwise by the always-on check that travels with the data
// (inside a small payload, beside a large one round the ring, or as a
// region reduced with a reduction's data, dist/reduce_check.h). A
// difference breaks the group and raises on this rank with a report naming
// each rank's call. Internal to dist.
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dist/fingerprint.h"
#include "dist/group_call.h"
#include "dist/store/store.h"
#include "engine/tensor.h"

namespace quanta::dist {

class ProcessGroup::Checks {
 public:
  explicit Checks(ProcessGroup& group) : g_(group) {}

  /** Room for a small all_reduce's data in a debug exchange: such a payload
   * travels in the same round trip as the fingerprints. */
  static constexpr std::size_t kDebugPayload = 4096;

  /** Whether a payload this size carries the always-on check inside it
   * (staged with room for the check) rather than beside it. */
  static bool inline_ok(std::size_t payload_bytes);

  /** Debug mode, before a call moves data: every rank's fingerprint is
   * exchanged and compared. */
  void fingerprints_before(const Call& call);

  /** Debug mode's all_reduce of a small host-readable `buf`: the data
   * travels with the fingerprints and is reduced in rank order on every
   * rank (bitwise equal results). */
  void fused_debug_all_reduce(const Call& call, const Tensor& buf, ReduceOp op);

  /** The always-on check found different calls (`diff`: compare()'s
   * report): breaks the group and raises on this rank. */
  [[noreturn]] void mismatch(const Call& call, const std::string& diff);

  /** A reduction's check region says the ranks differ: learn their calls
   * through the store, then mismatch(). */
  [[noreturn]] void reduction_mismatch(const Call& call);

  /** A buffer of at least `bytes` on `device` for the always-on check's
   * staged payloads, kept for the next call. */
  Tensor staging(std::size_t bytes, Device device);

  /** The always-on check of a large reduction, in a small call after it. */
  void reduction_after(const Call& call, DType dtype, ReduceOp op);

  /** A large byte collective `run` with its always-on check beside it: each
   * rank sends its fingerprint to the next rank of the ring while `run`
   * moves the data, and compares the previous rank's with its own after it.
   * Equal neighbours all round mean equal calls, so any difference raises
   * on at least one rank (the others' next collective then fails), and the
   * payload is neither copied nor followed by a round of its own. A
   * broadcast cuts the ring before its root (`root` >= 0), which then
   * neither waits nor learns (as with the check inside small payloads). */
  void beside_ring(const Call& call, const std::function<void()>& run, int root = -1);

 private:
  // Every debug exchange sends one fixed-size block: the fingerprint and room
  // for a small all_reduce's data (sent along in the same round trip). The
  // size and the tag depend on nothing but the sequence number, so any two
  // calls at the same point meet there, whatever op, dtype or shape they are.
  static constexpr std::size_t kDebugBlock = sizeof(detail::Fingerprint) + kDebugPayload;

  std::vector<char> debug_exchange(const Call& call, const void* payload, std::size_t bytes);
  void compare_debug(const Call& call, const std::vector<detail::Fingerprint>& all);

  ProcessGroup& g_;
  Tensor staging_;  // see staging()
};

namespace detail {
/** What the other ranks posted under `prefix` + their rank, each read once
 * it appears, for up to `grace` (failing ranks post before they read, so
 * all of them see each other's posts; ranks busy elsewhere stay empty). */
std::vector<std::optional<Bytes>> await_posts(Store& store, int rank, int size,
                                              const std::string& prefix, Millis grace);
/** How long a failing rank waits for the others' posts. */
Millis grace_of(Millis timeout);
/** Where rank `rank` posts what it was doing when a call failed. */
std::string status_key(int rank);
}  // namespace detail

}  // namespace quanta::dist
