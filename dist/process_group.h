#pragma once
// ProcessGroup: the ranks of one job and the collectives between them.
//
// Safety (docs/design.md "Distributed rules"): every collective has a deadline
// (the group's timeout or a per-call one). On a timeout, a lost peer or a
// mismatch, every rank that is waiting raises DistError naming the
// collective, its sequence number and the ranks that did not arrive (or
// what they were doing instead); the group is then broken and every later
// call fails at once. With debug on (QUANTA_DIST_DEBUG=1), ranks first
// exchange a fingerprint of the call (op, sequence number, dtype, shape,
// reduce op, root, call site) and raise on any difference before moving data.
// Without it, every collective that moves data carries a check with its
// payload (the fingerprint itself, or for reductions a region reduced with
// the data, dist/reduce_check.h) and raises after the call, instead of
// returning, when the ranks made different calls (docs/dist.md).
//
// Collectives run on CPU tensors through Gloo (TCP); CUDA tensors go to NCCL
// when built with CUDA: the group holds both behind one interface
// (detail::Backend, dist/backend/backend.h) and picks one by tensor device. World
// size 1 needs no backend: collectives are identities, so every program runs
// unchanged on one process.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <source_location>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/store/store.h"
#include "engine/tensor.h"

namespace quanta::dist {

/** How all_reduce and reduce_scatter combine the ranks' values. */
enum class ReduceOp { sum, avg, min, max, prod };
/** "sum", "avg", ... */
const char* reduce_op_name(ReduceOp op);

/** A collective failed: timeout, lost rank, mismatch, or a broken group. */
struct DistError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** Per-call options. */
struct CallOptions {
  /** Deadline for this call; zero means the group's timeout. */
  Millis timeout{0};
};

/** How a group is made. */
struct GroupOptions {
  /** Default deadline of every collective (and of rendezvous). */
  Millis timeout{std::chrono::minutes(5)};
  /** Fingerprint check before each collective; -1 reads QUANTA_DIST_DEBUG. */
  int debug = -1;
  /** Root seed of the rank-consistent random streams; 0 = rank 0 draws one. */
  uint64_t seed = 0;
  /** Names the group in the store (groups sharing a store need distinct names). */
  std::string name = "world";
  /** Address this rank's Gloo device binds to; empty = QUANTA_DIST_HOST,
   * else 127.0.0.1 when the store is local, else this host's name. */
  std::string host{};
  /** Network interface for Gloo (GLOO_SOCKET_IFNAME style); overrides host. */
  std::string iface{};
};

class ProcessGroup;
namespace detail {
class Backend;
class GlooBackend;
struct Fingerprint;
struct StreamCalls;
/** The group's Gloo backend (null for a world of one): for benchmarks that
 * time the bare Gloo call on the same connections. */
GlooBackend* gloo_backend_of(ProcessGroup& g);
}  // namespace detail

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  using Site = std::source_location;

  /** Joins the group: rendezvous through `store`, agrees the root seed. All
   * ranks must construct it; throws DistError after `opts.timeout`. */
  ProcessGroup(std::shared_ptr<Store> store, int rank, int world_size, GroupOptions opts = {});
  /** A group of one process (no store, no backend). */
  static std::shared_ptr<ProcessGroup> single(GroupOptions opts = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /** The root seed agreed at creation (identical on every rank). */
  uint64_t seed() const { return seed_; }
  /** How many collectives this rank has issued on this group. */
  uint64_t sequence() const { return seq_; }
  /** Whether fingerprints are checked before each collective. */
  bool debug() const { return debug_; }
  /** The group's default timeout. */
  Millis timeout() const { return opts_.timeout; }
  /** Set when a collective failed: every later call throws this message. */
  const std::string& broken() const { return broken_; }
  /** Counts the requests for random stream `key` on this rank: returns how
   * many came before this one (0, 1, 2, ...), so each request gets its own
   * range (shared_generator, rank_generator). Local, no communication; a
   * group and its clones count together. Thread-safe. */
  uint64_t next_stream_call(const std::string& key);

  /** A new group over the same ranks with its own connections and sequence
   * (DataParallel reduces gradients on one, on another thread). Collective:
   * every rank must call it in the same order. */
  std::shared_ptr<ProcessGroup> clone(const std::string& purpose);
  /** Makes the transport for tensors on `device` now rather than at the
   * first collective: on a GPU, NCCL's communicator (a rendezvous of every
   * rank; nothing on the CPU and sim, whose Gloo connections exist, or in a
   * group of one). A group whose collectives run on a worker thread (a
   * clone's) connects on the thread that made it, in program order: NCCL
   * warns that a communicator made while another one's kernels run, on
   * another thread, may deadlock. Collective on a GPU: every rank calls it
   * in the same order. */
  void connect(Device device);

  // ---- collectives (every rank calls the same ones in the same order) ----
  /** Reduces `t` across ranks in place (any contiguous or strided tensor).
   * Arithmetic dtypes only; avg needs a floating dtype. */
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum, CallOptions o = {},
                  Site site = Site::current());
  /** Reduces `t` across ranks into root's `t` (in place there); the other
   * ranks' `t` keep their values. Arithmetic dtypes only; avg needs a
   * floating dtype. */
  void reduce(const Tensor& t, int root, ReduceOp op = ReduceOp::sum, CallOptions o = {},
              Site site = Site::current());
  /** Copies root's `t` into `t` on every rank, as bytes (any dtype, nf4 too). */
  void broadcast(const Tensor& t, int root, CallOptions o = {}, Site site = Site::current());
  /** Every rank's `t` concatenated along dim 0 in rank order: [N * d0, ...]
   * (a 0-d input gives [N]). Bytes: any dtype. */
  Tensor all_gather(const Tensor& t, CallOptions o = {}, Site site = Site::current());
  /** Like all_gather, but dim 0 may differ per rank (zero included); other
   * dims and dtype must agree. `sizes` (optional) receives each rank's d0. */
  Tensor all_gather_v(const Tensor& t, std::vector<int64_t>* sizes = nullptr, CallOptions o = {},
                      Site site = Site::current());
  /** `t` has dim 0 = N * m: returns [m, ...], rank r's block reduced across
   * ranks (block r of every rank's `t`). */
  Tensor reduce_scatter(const Tensor& t, ReduceOp op = ReduceOp::sum, CallOptions o = {},
                        Site site = Site::current());
  /** `t` has dim 0 = N * m: block j goes to rank j; the result's block j came
   * from rank j. Bytes: any dtype. */
  Tensor all_to_all(const Tensor& t, CallOptions o = {}, Site site = Site::current());
  /** Returns when every rank has called barrier. */
  void barrier(CallOptions o = {}, Site site = Site::current());

 private:
  struct Call;
  class Checks;  // dist/call_checks.h
  friend detail::GlooBackend* detail::gloo_backend_of(ProcessGroup& g);
  ProcessGroup(int rank, int size, GroupOptions opts);
  Call begin(const char* op, const Tensor* t, int shape_rule, ReduceOp rop, int root,
             const CallOptions& o, const Site& site, bool exchange_fingerprints = true);
  [[noreturn]] void fail(const Call& call, const std::string& what);
  /** Whether this call carries the always-on check (debug mode compares the
   * whole fingerprints before the call instead). */
  bool checked() const { return size_ > 1 && !debug_; }
  template <class F>
  void guarded(const Call& call, F&& f);
  /** The backend for tensors on `t`'s device: CPU -> Gloo, CUDA -> NCCL
   * (made on `t`'s device at the first CUDA collective, bounded by
   * `init_timeout`). */
  detail::Backend& backend_for(const Tensor& t, Millis init_timeout);
  detail::Backend& backend_for(Device device, Millis init_timeout);
  /** The Gloo backend (the host transport: debug exchanges, barriers, clones). */
  detail::GlooBackend& gloo();

  int rank_ = 0;
  int size_ = 1;
  GroupOptions opts_;
  bool debug_ = false;
  uint64_t seed_ = 0;
  uint64_t seq_ = 0;
  uint64_t clones_ = 0;
  std::string broken_;
  std::shared_ptr<Store> root_store_;                  // shared with clones
  std::shared_ptr<Store> store_;                       // scoped to this group
  std::unique_ptr<detail::Backend> gloo_;              // a GlooBackend; null in a world of one
  std::unique_ptr<detail::Backend> nccl_;              // made at the first CUDA collective
  std::shared_ptr<detail::StreamCalls> stream_calls_;  // shared with clones
  std::unique_ptr<Checks> checks_;                     // see dist/call_checks.h
};

}  // namespace quanta::dist
