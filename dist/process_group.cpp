// ProcessGroup: call bookkeeping (sequence numbers, tags, deadlines), the
// debug fingerprint check, the always-on in-band check, failure reports, and
// the collectives: tensors are checked and staged here, the bytes move
// through the backend of their device (backend_for: Gloo for CPU tensors,
// NCCL for CUDA tensors).
#include "dist/process_group.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "dist/backend.h"
#include "dist/env.h"
#include "dist/fingerprint.h"
#include "dist/gloo_backend.h"
#include "dist/group_call.h"
#include "dist/nccl_backend.h"
#include "dist/reduce_check.h"
#include "dist/reduce_kernels.h"
#include "dist/rendezvous.h"
#include "engine/autograd/grad_mode.h"
#include "engine/device_backend.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/random/generator.h"
#include "engine/sim/sim_stream.h"
#include "engine/storage.h"

namespace quanta::dist {

namespace detail {
// How often each random stream was asked for (ProcessGroup::next_stream_call).
struct StreamCalls {
  std::mutex m;
  std::unordered_map<std::string, uint64_t> calls;
};
}  // namespace detail

using detail::Fingerprint;
using Clock = std::chrono::steady_clock;

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
    case ReduceOp::prod:
      return "prod";
  }
  return "?";
}

namespace {

std::string default_host() {
  if (const char* h = std::getenv("QUANTA_DIST_HOST"); h && *h) return h;
  const char* master = std::getenv("MASTER_ADDR");
  const std::string m = master ? master : "";
  if (m.empty() || m == "127.0.0.1" || m == "localhost" || m == "::1") return "127.0.0.1";
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

// A block dtype's view (nf4) is a byte range only when it is contiguous and
// starts on a storage unit; anything else cannot be moved as bytes. (An
// empty view has no bytes to move, wherever it starts.)
void check_byte_range(const char* op, const Tensor& t) {
  const DTypeInfo& info = dtype_info(t.dtype());
  if (!t.is_contiguous() && !info.arithmetic)
    throw std::invalid_argument(std::string("[dist::") + op + "] a non-contiguous " + info.name +
                                " tensor cannot be moved as bytes");
  const int64_t unit = static_cast<int64_t>(info.block_elems);
  if (unit > 1 && t.numel() != 0 && t.offset() % unit != 0)
    throw std::invalid_argument(std::string("[dist::") + op + "] this " + info.name +
                                " view starts at element " + std::to_string(t.offset()) +
                                ", inside a " + std::to_string(unit) +
                                "-element block: it is not a byte range and cannot be moved");
}

// A contiguous tensor holding `t`'s values to operate on in place; write it
// back with finish_inplace when it is a copy.
Tensor inplace_buffer(const char* op, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string("[dist::") + op + "] undefined tensor");
  check_byte_range(op, t);
  if (t.numel() == 0) return quanta::detail::make_tensor(t.shape(), t.dtype(), t.device());
  if (t.is_contiguous()) return t;
  NoGradGuard g;
  return t.detach().contiguous();
}

void finish_inplace(const Tensor& t, const Tensor& buf) {
  if (buf.is_same(t) || t.numel() == 0) return;
  NoGradGuard g;
  copy_(t.detach(), buf);
}

Tensor contiguous_input(const char* op, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string("[dist::") + op + "] undefined tensor");
  check_byte_range(op, t);
  // Empty: a fresh tensor, so no address is taken inside someone's block.
  if (t.numel() == 0) return quanta::detail::make_tensor(t.shape(), t.dtype(), t.device());
  NoGradGuard g;
  if (t.is_contiguous()) return t.detach();
  return t.detach().contiguous();
}

// Bytes of `elems` elements of `dtype`: whole storage units for block dtypes
// (a partial last unit is stored in full), elems * size for the others.
std::size_t bytes_of(DType dtype, int64_t elems) {
  const DTypeInfo& info = dtype_info(dtype);
  const auto unit = static_cast<int64_t>(info.block_elems);
  return static_cast<std::size_t>((elems + unit - 1) / unit) * info.block_bytes;
}

// Gathers lay the ranks' pieces end to end as bytes. For a block dtype (nf4:
// 64 elements in 36 bytes) that is the result's layout only when every piece
// but the last non-empty one is whole units: otherwise the next piece would
// have to start inside a unit (and its bytes land in the wrong place, or past
// the end of the result). `pieces[r]` is rank r's piece in elements. Every
// rank passes the same pieces, so every rank raises the same error before
// moving a byte.
void check_whole_units(const char* op, DType dtype, const std::vector<int64_t>& pieces,
                       int64_t row_elems) {
  const DTypeInfo& info = dtype_info(dtype);
  const auto unit = static_cast<int64_t>(info.block_elems);
  if (unit == 1) return;
  int last = -1;
  for (int r = 0; r < static_cast<int>(pieces.size()); ++r)
    if (pieces[r] != 0) last = r;
  for (int r = 0; r < last; ++r) {
    if (pieces[r] % unit == 0) continue;
    std::ostringstream msg;
    msg << "[dist::" << op << "] " << info.name << " pieces must be whole " << unit
        << "-element blocks (" << info.block_bytes << " bytes each) to be moved as bytes: got "
        << pieces[r] << " elements from rank " << r;
    if (row_elems > 0) {
      const int64_t rows = pieces[r] / row_elems;
      msg << " (" << rows << (rows == 1 ? " row" : " rows") << " of " << row_elems << ")";
    }
    msg << ", so the next piece would start inside a block. Only the last piece may end in a "
           "partial block: shard whole blocks (rows of a multiple of "
        << unit << " elements, or row counts that make whole blocks)";
    throw std::invalid_argument(msg.str());
  }
}

// The elements in one dim-0 row of `t`.
int64_t row_elems_of(const Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// Every rank has finished connecting before any returns from making a
// group. Gloo's connect returns once this rank's own pairs are up, while a
// peer may still be handshaking; a rank that then ran a collective and left
// at once would close a pair under that peer's feet ("connection closed by
// peer" during its rendezvous). One key per rank in the store, waited for
// with the group's timeout.
void await_all_connected(Store& store, int rank, int size, Millis timeout) {
  store.set_string("connected/" + std::to_string(rank), "1");
  for (int r = 0; r < size; ++r) store.get_string("connected/" + std::to_string(r), timeout);
}

uint32_t sub_tag(uint32_t tag, uint32_t k) {
  return static_cast<uint32_t>(quanta::detail::splitmix64((uint64_t(tag) << 8) | k));
}

}  // namespace

namespace {

// Where rank `rank` posts what it was doing when a call failed (fail()).
std::string status_key(int rank) { return "status/" + std::to_string(rank); }

// Should this process be killed, the store posts its status for it, and a
// peer's fail() names it at once rather than after the report's grace.
void leave_will(Store& store, int rank) {
  const std::string died = "died: its process ended (killed, or exited) without leaving the group";
  store.set_will(status_key(rank), Bytes(died.begin(), died.end()));
}

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size, GroupOptions opts)
    : rank_(rank),
      size_(size),
      opts_(std::move(opts)),
      stream_calls_(std::make_shared<detail::StreamCalls>()) {
  debug_ = opts_.debug < 0 ? env_flag("QUANTA_DIST_DEBUG") : opts_.debug != 0;
  if (opts_.timeout <= Millis(0))
    throw std::invalid_argument("[dist] the group timeout must be positive");
}

ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, int rank, int world_size,
                           GroupOptions opts)
    : ProcessGroup(rank, world_size, std::move(opts)) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("[dist] rank " + std::to_string(rank) + " is outside a world of " +
                                std::to_string(world_size));
  if (!store && world_size > 1)
    throw std::invalid_argument("[dist] a group of several ranks needs a store");
  root_store_ = store;
  if (world_size == 1) {
    seed_ = opts_.seed ? opts_.seed : std::random_device{}() * 0x100000001ull;
    return;
  }
  store_ = std::make_shared<PrefixStore>("quanta/" + opts_.name, store);
  try {
    // Every rank present, each once, before Gloo connects (Gloo would wait
    // silently, and hang on a rank started twice).
    detail::join_group(*store_, rank, world_size, opts_.timeout,
                       store->describe() + " (group '" + opts_.name + "')");
    PrefixStore gloo_store("gloo", store_);
    const std::string host = opts_.host.empty() ? default_host() : opts_.host;
    gloo_ = std::make_unique<detail::GlooBackend>(gloo_store, rank, world_size, opts_.timeout, host,
                                                  opts_.iface);
    // The root seed: rank 0 decides, everyone else reads it once. This is
    // the only communication the random streams ever need.
    if (rank == 0) {
      uint64_t s = opts_.seed;
      if (s == 0) {
        std::random_device rd;
        s = (uint64_t(rd()) << 32) | rd();
      }
      store_->set_string("seed", std::to_string(s));
    }
    seed_ = std::stoull(store_->get_string("seed", opts_.timeout));
    await_all_connected(*store_, rank, world_size, opts_.timeout);
    detail::check_no_duplicate(*store_);  // a duplicate that came while we connected
    leave_will(*store_, rank);
  } catch (const std::exception& e) {
    throw DistError("[dist] rendezvous of group '" + opts_.name + "' failed on rank " +
                    std::to_string(rank) + " of " + std::to_string(world_size) + " through " +
                    store->describe() + ": " + e.what());
  }
}

std::shared_ptr<ProcessGroup> ProcessGroup::single(GroupOptions opts) {
  return std::make_shared<ProcessGroup>(nullptr, 0, 1, std::move(opts));
}

ProcessGroup::~ProcessGroup() {
  // A failed group's store outlives this rank's exit for a moment when this
  // rank hosts it (normally rank 0): the ranks that learn of the failure
  // from this process's closed connections ask it who did not arrive.
  if (!broken_.empty())
    if (auto* tcp = dynamic_cast<TcpStore*>(root_store_.get()))
      tcp->linger_on_close(std::chrono::seconds(3));
  // Tell peers still waiting on us that we left on purpose (fail() reads it).
  if (store_ && broken_.empty()) {
    try {
      store_->set_string(status_key(rank_),
                         "left the group after " + std::to_string(seq_) + " collectives");
    } catch (...) {
    }
  }
  if (store_) {
    try {
      store_->clear_will(status_key(rank_));
    } catch (...) {
    }
  }
}

std::shared_ptr<ProcessGroup> ProcessGroup::clone(const std::string& purpose) {
  const std::string name = opts_.name + "/" + purpose + "." + std::to_string(clones_++);
  GroupOptions o = opts_;
  o.name = name;
  auto g = std::shared_ptr<ProcessGroup>(new ProcessGroup(rank_, size_, o));
  g->root_store_ = root_store_;
  g->seed_ = seed_;
  g->debug_ = debug_;
  g->stream_calls_ = stream_calls_;
  if (size_ == 1) return g;
  g->store_ = std::make_shared<PrefixStore>("quanta/" + name, root_store_);
  try {
    PrefixStore gloo_store("gloo", g->store_);
    g->gloo_ = std::make_unique<detail::GlooBackend>(gloo_store, rank_, size_, opts_.timeout,
                                                     gloo().device());
    await_all_connected(*g->store_, rank_, size_, opts_.timeout);
    leave_will(*g->store_, rank_);
  } catch (const std::exception& e) {
    throw DistError("[dist] creating group '" + name + "' failed on rank " + std::to_string(rank_) +
                    ": " + e.what());
  }
  return g;
}

uint64_t ProcessGroup::next_stream_call(const std::string& key) {
  std::lock_guard<std::mutex> lock(stream_calls_->m);
  return stream_calls_->calls[key]++;
}

// gloo_ only ever holds a GlooBackend (made in the constructor and clone).
detail::GlooBackend& ProcessGroup::gloo() { return static_cast<detail::GlooBackend&>(*gloo_); }

detail::GlooBackend* detail::gloo_backend_of(ProcessGroup& g) {
  return g.gloo_ ? &g.gloo() : nullptr;
}

detail::Backend& ProcessGroup::backend_for(const Tensor& t, Millis init_timeout) {
  if (!t.device().is_cuda()) {
    // Gloo moves a sim device's bytes where NCCL would move a GPU's, and
    // waits where NCCL's stream waits: for this thread's ready event when
    // one is set (DataParallel's bucket, whose copies are before it; later
    // kernels run on beside the transfer), else for everything queued on
    // the device. Like the NCCL backend's host wait, it moves no data: no
    // host sync.
    if (t.device().is_sim()) {
      if (const void* e = detail::ready_event())
        sim::wait_event(*static_cast<const sim::Event*>(e));
      else
        synchronize(t.device());
    }
    return *gloo_;
  }
  if (!nccl_) {
    // One communicator per group, on the device of its first CUDA tensor;
    // its keys live under the group's store.
    const int index = t.device().index;
    PrefixStore s("nccl." + std::to_string(index), store_);
    nccl_ = detail::make_nccl_backend(s, rank_, size_, index, init_timeout);
  }
  return *nccl_;
}

// ---- call bookkeeping ----

ProcessGroup::Call ProcessGroup::begin(const char* op, const Tensor* t, int shape_rule,
                                       ReduceOp rop, int root, const CallOptions& o,
                                       const Site& site, bool exchange_fingerprints) {
  const bool reduces = std::strcmp(op, "all_reduce") == 0 || std::strcmp(op, "reduce_scatter") == 0;
  Call c;
  c.fp = detail::make_fingerprint(op, seq_, t, shape_rule, reduces ? int32_t(rop) : -1, root, site);
  if (!broken_.empty())
    throw DistError("[dist] " + c.desc() + " on rank " + std::to_string(rank_) +
                    ": the group is broken by an earlier failure: " + broken_);
  if (t && t->defined() && t->device().is_cuda() && !cuda_built())
    throw std::invalid_argument("[dist::" + std::string(op) +
                                "] CUDA tensor, but quanta was built without CUDA");
  ++seq_;
  c.tag = detail::tag_of(c.fp);
  c.word = detail::check_word(c.fp);
  c.timeout = o.timeout > Millis(0) ? o.timeout : opts_.timeout;
  c.start = Clock::now();
  if (size_ > 1 && debug_ && exchange_fingerprints) check_fingerprints(c);
  return c;
}

namespace {
// Every debug exchange sends one fixed-size block: the fingerprint and room
// for a small all_reduce's data (sent along in the same round trip). The
// size and the tag depend on nothing but the sequence number, so any two
// calls at the same point meet here, whatever op, dtype or shape they are.
constexpr std::size_t kDebugPayload = 4096;
constexpr std::size_t kDebugBlock = sizeof(Fingerprint) + kDebugPayload;
}  // namespace

std::vector<char> ProcessGroup::debug_exchange(const Call& call, const void* payload,
                                               std::size_t bytes) {
  std::vector<char> mine(kDebugBlock, 0), all(kDebugBlock * static_cast<std::size_t>(size_));
  std::memcpy(mine.data(), &call.fp, sizeof(Fingerprint));
  if (bytes) std::memcpy(mine.data() + sizeof(Fingerprint), payload, bytes);
  const uint32_t tag = static_cast<uint32_t>(quanta::detail::splitmix64(call.fp.seq ^ 0x6670ull));
  guarded(call,
          [&] { gloo_->all_gather(mine.data(), all.data(), kDebugBlock, tag, call.timeout); });
  std::vector<Fingerprint> fps(size_);
  for (int r = 0; r < size_; ++r)
    std::memcpy(&fps[r], all.data() + r * kDebugBlock, sizeof(Fingerprint));
  check_fingerprints(call, fps);
  return all;
}

void ProcessGroup::check_fingerprints(const Call& call) { debug_exchange(call, nullptr, 0); }

void ProcessGroup::check_fingerprints(const Call& call, const std::vector<Fingerprint>& all) {
  const std::string diff = detail::compare(all);
  if (diff.empty()) return;
  broken_ = "QUANTA_DIST_DEBUG: " + diff;
  throw DistError("[dist] " + call.desc() + " on rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + ": " + broken_);
}

namespace {
// What the other ranks posted under `prefix` + their rank, each read once it
// appears, for up to `grace` (failing ranks post before they read, so all
// of them see each other's posts; ranks busy elsewhere stay empty).
std::vector<std::optional<Bytes>> await_posts(Store& store, int rank, int size,
                                              const std::string& prefix, Millis grace) {
  std::vector<std::optional<Bytes>> posts(size);
  const auto deadline = Clock::now() + grace;
  for (;;) {
    bool all = true;
    for (int r = 0; r < size; ++r) {
      if (r == rank || posts[r]) continue;
      const std::string key = prefix + std::to_string(r);
      if (store.check(key))
        posts[r] = store.get(key, Millis(1000));
      else
        all = false;
    }
    if (all || Clock::now() >= deadline) return posts;
    std::this_thread::sleep_for(Millis(20));
  }
}

// How long a failing rank waits for the others' posts.
Millis grace_of(Millis timeout) { return std::clamp(timeout / 2, Millis(300), Millis(2000)); }
}  // namespace

void ProcessGroup::fail(const Call& call, const std::string& what) {
  const auto waited = std::chrono::duration_cast<Millis>(Clock::now() - call.start).count();
  std::ostringstream msg;
  msg << "[dist] " << call.desc() << " failed on rank " << rank_ << " of " << size_ << " after "
      << waited << " ms: " << what;
  broken_ = msg.str();  // from now on every call fails at once
  // Ask the peers what they were doing: each failing rank posts its call,
  // ranks that left on purpose posted that; the rest did not arrive.
  std::vector<std::string> reports(size_);
  const Millis grace = grace_of(call.timeout);
  try {
    store_->set_string(status_key(rank_), call.desc());
    // A survivor blocked on an exchange with this rank would otherwise wait
    // for it until its own timeout: it learns of the failure now, and posts.
    if (gloo_) gloo_->close_connections();
    const auto posts = await_posts(*store_, rank_, size_, "status/", grace);
    for (int r = 0; r < size_; ++r)
      if (posts[r]) reports[r].assign(posts[r]->begin(), posts[r]->end());
  } catch (const std::exception& e) {
    msg << "\n  (could not ask the other ranks: " << e.what() << ")";
    broken_ = msg.str();
    throw DistError(broken_);
  }
  const std::string mine = call.desc().substr(0, call.desc().find(" at "));
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const std::string& rep = reports[r];
    if (rep.empty())
      missing.push_back(r);
    else if (rep.rfind("left", 0) == 0 || rep.rfind("failed", 0) == 0 || rep.rfind("died", 0) == 0)
      msg << "\n  rank " << r << " " << rep;
    else if (rep.substr(0, rep.find(" at ")) == mine)
      msg << "\n  rank " << r << " arrived and failed too";
    else
      msg << "\n  rank " << r << " was in " << rep << " instead";
  }
  if (!missing.empty()) {
    msg << "\n  ranks that did not arrive: ";
    for (std::size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << missing[i];
    msg << " (no report within " << grace.count() << " ms: busy elsewhere, hung, or dead)";
  }
  broken_ = msg.str();
  throw DistError(broken_);
}

// ---- the always-on check ----

void ProcessGroup::mismatch(const Call& call, const std::string& diff) {
  broken_ = diff;
  // A rank that fails later in another call (the root of a broadcast
  // learns nothing from it) reads why this one left.
  try {
    store_->set_string(status_key(rank_), "failed the check of " + call.desc() +
                                              ": the ranks called different "
                                              "collectives");
  } catch (...) {
  }
  throw DistError("[dist] " + call.desc() + " on rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + ": " + diff);
}

void ProcessGroup::reduction_mismatch(const Call& call) {
  // Every rank of a reduction sees the same result, so all of them are
  // here: each posts its fingerprint and reads the others'.
  std::vector<Fingerprint> fps;
  std::vector<int> ranks, silent;
  const Millis grace = grace_of(call.timeout);
  std::string trouble;
  try {
    const auto* p = reinterpret_cast<const char*>(&call.fp);
    store_->set("fingerprint/" + std::to_string(rank_), Bytes(p, p + sizeof(Fingerprint)));
    const auto posts = await_posts(*store_, rank_, size_, "fingerprint/", grace);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        fps.push_back(call.fp);
        ranks.push_back(r);
      } else if (posts[r] && posts[r]->size() == sizeof(Fingerprint)) {
        Fingerprint f;
        std::memcpy(&f, posts[r]->data(), sizeof f);
        fps.push_back(f);
        ranks.push_back(r);
      } else {
        silent.push_back(r);
      }
    }
  } catch (const std::exception& e) {
    trouble = e.what();
  }
  if (fps.empty()) {
    fps.push_back(call.fp);
    ranks.push_back(rank_);
  }
  std::string diff = detail::compare(fps, ranks);
  if (diff.empty()) diff = "ranks called different collectives: the check of the reduction failed";
  if (!silent.empty()) {
    diff += "\n  ranks that did not say which call they were in within " +
            std::to_string(grace.count()) + " ms: ";
    for (std::size_t i = 0; i < silent.size(); ++i)
      diff += (i ? ", " : "") + std::to_string(silent[i]);
  }
  if (!trouble.empty()) diff += "\n  (could not ask the other ranks: " + trouble + ")";
  mismatch(call, diff);
}

namespace {
// Up to this many payload bytes the check travels inside the payload of
// broadcast, all_gather, all_to_all and reduce_scatter: the payload is
// copied into a staging buffer with room for it. Above it, the copies (up to
// world size + 1 payloads for the gathers) cost more than a second small
// call (measured on the 2-core VM: copying 1 MiB twice ~0.1 ms, a small
// round trip ~0.05-0.1 ms), so the data moves as before and the
// fingerprints go round the ring beside it, in two small messages per rank
// that overlap the data (run_beside_ring_check, sub-tag kCheckTag; before,
// a gather of the fingerprints after the data cost 12-25% at 1 MiB).
// all_reduce sends its check region through Backend::all_reduce_checked.
constexpr std::size_t kInlineCheckBytes = std::size_t(64) << 10;
constexpr uint32_t kCheckTag = 0xC5;
bool inline_check(std::size_t payload_bytes) { return payload_bytes <= kInlineCheckBytes; }
}  // namespace

Tensor ProcessGroup::staging(std::size_t bytes, Device device) {
  if (staging_.defined() && staging_.device() == device && staging_.nbytes() >= bytes)
    return staging_;
  // Only inline checks stage, so this stays small (world size + 1 blocks of
  // at most kInlineCheckBytes); keeping it spares an allocation per call.
  staging_ = quanta::detail::make_tensor({static_cast<int64_t>(bytes)}, DType::u8, device);
  return staging_;
}

void ProcessGroup::reduction_check_after(const Call& c, DType dtype, ReduceOp op) {
  // The region alone, on the host transport: reduced exactly as it would
  // have been inside the payload.
  std::vector<char> region = detail::check_region(c.word, dtype);
  guarded(c, [&] {
    gloo().all_reduce(region.data(), detail::kCheckElems, dtype, op, sub_tag(c.tag, kCheckTag),
                      c.timeout);
  });
  if (!detail::check_region_holds(region.data(), c.word, dtype, op)) reduction_mismatch(c);
}

void ProcessGroup::run_beside_ring_check(const Call& c, const std::function<void()>& run,
                                         int root) {
  Fingerprint previous{};
  bool received = false;
  guarded(c, [&] {
    received = gloo().ring_exchange(&c.fp, &previous, sizeof(Fingerprint),
                                    sub_tag(c.tag, kCheckTag), c.timeout, run, root);
  });
  if (!received) return;
  // Named lower rank first, as a gather of every fingerprint would name them.
  const int before = (rank_ + size_ - 1) % size_;
  const std::string diff = before < rank_ ? detail::compare({previous, c.fp}, {before, rank_})
                                          : detail::compare({c.fp, previous}, {rank_, before});
  if (!diff.empty()) mismatch(c, diff);
}

// ---- collectives ----

void ProcessGroup::fused_debug_all_reduce(const Call& c, const Tensor& buf, ReduceOp op) {
  const std::size_t nbytes = buf.nbytes();
  const std::vector<char> all = debug_exchange(c, buf.raw_data(), nbytes);
  // The same reduction in rank order on every rank: bitwise equal results.
  const std::size_t n = static_cast<std::size_t>(buf.numel());
  const auto fn = detail::reduce_fn(buf.dtype(), op);
  const char* data0 = all.data() + sizeof(Fingerprint);
  std::memcpy(buf.raw_data(), data0, nbytes);
  for (int r = 1; r < size_; ++r) fn(buf.raw_data(), buf.raw_data(), data0 + r * kDebugBlock, n);
}

void ProcessGroup::all_reduce(const Tensor& t, ReduceOp op, CallOptions o, Site site) {
  if (t.defined()) detail::check_reducible("all_reduce", t.dtype(), op);
  // Debug mode's fingerprint exchange can carry a small payload read in
  // place: only memory the host reads directly, never a device's.
  const bool fuse = debug_ && size_ > 1 && t.defined() && device_caps(t.device()).host_readable &&
                    t.nbytes() <= kDebugPayload;
  Call c = begin("all_reduce", &t, detail::kSameShape, op, -1, o, site, !fuse);
  if (size_ == 1) return;
  Tensor buf = inplace_buffer("all_reduce", t);
  const std::size_t n = static_cast<std::size_t>(buf.numel());
  if (fuse) {
    fused_debug_all_reduce(c, buf, op);
    if (op == ReduceOp::avg) detail::divide(buf.raw_data(), buf.dtype(), n, size_);
    finish_inplace(t, buf);
    return;
  }
  if (!checked() || n == 0) {
    guarded(c, [&] {
      backend_for(buf, c.timeout).all_reduce(buf.raw_data(), n, buf.dtype(), op, c.tag, c.timeout);
    });
    finish_inplace(t, buf);
    return;
  }
  // The check region (reduce_check.h) is reduced in the same call, from host
  // memory; the transport decides how it travels (Gloo on two ranks: in the
  // same exchange as the data, without a copy; NCCL: in the same group, on
  // its own stream, so no copy waits on the default stream's kernels).
  std::vector<char> region = detail::check_region(c.word, buf.dtype());
  guarded(c, [&] {
    backend_for(buf, c.timeout)
        .all_reduce_checked(buf.raw_data(), n, region.data(), detail::kCheckElems, buf.dtype(), op,
                            c.tag, c.timeout);
  });
  if (!detail::check_region_holds(region.data(), c.word, buf.dtype(), op)) reduction_mismatch(c);
  finish_inplace(t, buf);
}

void ProcessGroup::broadcast(const Tensor& t, int root, CallOptions o, Site site) {
  if (root < 0 || root >= size_)
    throw std::invalid_argument("[dist::broadcast] root " + std::to_string(root) +
                                " is outside a world of " + std::to_string(size_));
  if (!t.defined()) throw std::invalid_argument("[dist::broadcast] undefined tensor");
  check_byte_range("broadcast", t);
  Call c = begin("broadcast", &t, detail::kSameShape, ReduceOp::sum, root, o, site);
  if (size_ == 1 || t.numel() == 0) return;  // every rank has the shape: nothing to move
  Tensor buf = inplace_buffer("broadcast", t);
  if (!checked() || !inline_check(buf.nbytes())) {
    auto run = [&] {
      backend_for(buf, c.timeout).broadcast(buf.raw_data(), buf.nbytes(), root, c.tag, c.timeout);
    };
    // The chain from the root: the others compare, the root does not wait.
    if (checked())
      run_beside_ring_check(c, run, root);
    else
      guarded(c, run);
    finish_inplace(t, buf);
    return;
  }
  // Root's payload and fingerprint travel together; the other ranks compare
  // it with their own. (The root learns nothing from a broadcast: when its
  // peers raise, its next collective fails.)
  const Device dev = buf.device(), cpu = Device::cpu();
  const std::size_t bytes = buf.nbytes();
  const Tensor stage = staging(bytes + sizeof(Fingerprint), dev);
  char* s = static_cast<char*>(stage.raw_data());
  if (rank_ == root) {
    copy_bytes(s, dev, buf.raw_data(), dev, bytes);
    copy_bytes(s + bytes, dev, &c.fp, cpu, sizeof(Fingerprint));
  }
  guarded(c, [&] {
    backend_for(buf, c.timeout).broadcast(s, bytes + sizeof(Fingerprint), root, c.tag, c.timeout);
  });
  if (rank_ == root) return;
  Fingerprint theirs;
  copy_bytes(&theirs, cpu, s + bytes, dev, sizeof theirs);
  if (const std::string diff = detail::compare({theirs, c.fp}, {root, rank_}); !diff.empty())
    mismatch(c, diff);
  copy_bytes(buf.raw_data(), dev, s, dev, bytes);
  finish_inplace(t, buf);
}

Tensor ProcessGroup::all_gather(const Tensor& t, CallOptions o, Site site) {
  Tensor in = contiguous_input("all_gather", t);
  if (in.dim() == 0) in = in.reshape({1});
  check_whole_units("all_gather", in.dtype(), std::vector<int64_t>(size_, in.numel()),
                    row_elems_of(in));
  Call c = begin("all_gather", &in, detail::kSameShape, ReduceOp::sum, -1, o, site);
  Shape shape = in.shape();
  shape[0] *= size_;
  if (size_ == 1) {
    NoGradGuard g;
    return in.clone();
  }
  Tensor out = quanta::detail::make_tensor(shape, in.dtype(), in.device());
  const std::size_t bytes = in.nbytes();
  if (!checked() || bytes == 0 || !inline_check(bytes)) {
    auto run = [&] {
      backend_for(in, c.timeout).all_gather(in.raw_data(), out.raw_data(), bytes, c.tag, c.timeout);
    };
    if (checked() && bytes != 0)
      run_beside_ring_check(c, run);
    else
      guarded(c, run);
    return out;
  }
  // Every rank's block is its payload and its fingerprint: [N blocks | mine].
  const Device dev = in.device(), cpu = Device::cpu();
  const std::size_t block = bytes + sizeof(Fingerprint);
  const auto n = static_cast<std::size_t>(size_);
  const Tensor stage = staging(block * (n + 1), dev);
  char* s = static_cast<char*>(stage.raw_data());
  char* mine = s + block * n;
  copy_bytes(mine, dev, in.raw_data(), dev, bytes);
  copy_bytes(mine + bytes, dev, &c.fp, cpu, sizeof(Fingerprint));
  guarded(c, [&] { backend_for(in, c.timeout).all_gather(mine, s, block, c.tag, c.timeout); });
  std::vector<Fingerprint> fps(n);
  for (std::size_t r = 0; r < n; ++r)
    copy_bytes(&fps[r], cpu, s + r * block + bytes, dev, sizeof(Fingerprint));
  if (const std::string diff = detail::compare(fps); !diff.empty()) mismatch(c, diff);
  char* result = static_cast<char*>(out.raw_data());
  for (std::size_t r = 0; r < n; ++r)
    copy_bytes(result + r * bytes, dev, s + r * block, dev, bytes);
  return out;
}

Tensor ProcessGroup::all_gather_v(const Tensor& t, std::vector<int64_t>* sizes, CallOptions o,
                                  Site site) {
  Tensor in = contiguous_input("all_gather_v", t);
  if (in.dim() == 0)
    throw std::invalid_argument("[dist::all_gather_v] needs at least one dimension, got a scalar");
  Call c = begin("all_gather_v", &in, detail::kAnyFirstDim, ReduceOp::sum, -1, o, site);
  std::vector<int64_t> counts(size_, in.size(0));
  Shape shape = in.shape();
  if (size_ == 1) {
    if (sizes) *sizes = counts;
    NoGradGuard g;
    return in.clone();
  }
  // First the first dims (the tag already covers dtype and the other dims),
  // each with its rank's fingerprint: the always-on check, before any data.
  struct Piece {
    int64_t rows;
    Fingerprint fp;
  };
  const Piece mine{in.size(0), c.fp};
  std::vector<Piece> pieces_of(size_);
  guarded(c, [&] {
    gloo_->all_gather(&mine, pieces_of.data(), sizeof mine, sub_tag(c.tag, 1), c.timeout);
  });
  std::vector<Fingerprint> fps(size_);
  for (int r = 0; r < size_; ++r) {
    counts[r] = pieces_of[r].rows;
    fps[r] = pieces_of[r].fp;
  }
  if (const std::string diff = detail::compare(fps); !diff.empty()) mismatch(c, diff);
  int64_t total = 0;
  for (auto n : counts) total += n;
  // Every rank has the same counts now: a block dtype whose pieces would
  // split a unit fails here on every rank alike, before any data moves.
  const int64_t row = row_elems_of(in);
  std::vector<int64_t> pieces(size_);
  for (int r = 0; r < size_; ++r) pieces[r] = counts[r] * row;
  check_whole_units("all_gather_v", in.dtype(), pieces, row);
  shape[0] = total;
  Tensor out = quanta::detail::make_tensor(shape, in.dtype(), in.device());
  std::vector<std::size_t> bytes(size_);
  for (int r = 0; r < size_; ++r) bytes[r] = bytes_of(in.dtype(), pieces[r]);
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .all_gather_v(in.raw_data(), out.raw_data(), bytes, sub_tag(c.tag, 2 + uint32_t(total)),
                      c.timeout);
  });
  if (sizes) *sizes = counts;
  return out;
}

Tensor ProcessGroup::reduce_scatter(const Tensor& t, ReduceOp op, CallOptions o, Site site) {
  if (t.defined()) detail::check_reducible("reduce_scatter", t.dtype(), op);
  Tensor in = contiguous_input("reduce_scatter", t);
  if (in.dim() == 0 || in.size(0) % size_ != 0)
    throw std::invalid_argument(
        "[dist::reduce_scatter] dim 0 must be a multiple of the world size " +
        std::to_string(size_) + ", got shape " + shape_str(in.shape()));
  Call c = begin("reduce_scatter", &in, detail::kSameShape, op, -1, o, site);
  const int64_t m = in.size(0) / size_;
  if (size_ == 1) {
    NoGradGuard g;
    return in.clone();
  }
  Shape shape = in.shape();
  shape[0] = m;
  Tensor out = quanta::detail::make_tensor(shape, in.dtype(), in.device());
  const auto n_out = static_cast<std::size_t>(out.numel());
  if (!checked() || n_out == 0 || !inline_check(in.nbytes())) {
    guarded(c, [&] {
      backend_for(in, c.timeout)
          .reduce_scatter(in.raw_data(), out.raw_data(), n_out, in.dtype(), op, c.tag, c.timeout);
    });
    if (checked() && n_out != 0) reduction_check_after(c, in.dtype(), op);
    return out;
  }
  // Each rank's block r is followed by its check region, so the block this
  // rank receives reduced carries every rank's region reduced too.
  const Device dev = in.device(), cpu = Device::cpu();
  const std::vector<char> region = detail::check_region(c.word, in.dtype());
  const std::size_t bytes = out.nbytes(), block = bytes + region.size();
  const auto n = static_cast<std::size_t>(size_);
  const Tensor stage = staging(block * (n + 1), dev);
  char* s = static_cast<char*>(stage.raw_data());
  char* reduced = s + block * n;
  const char* from = static_cast<const char*>(in.raw_data());
  for (std::size_t r = 0; r < n; ++r) {
    copy_bytes(s + r * block, dev, from + r * bytes, dev, bytes);
    copy_bytes(s + r * block + bytes, dev, region.data(), cpu, region.size());
  }
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .reduce_scatter(s, reduced, n_out + detail::kCheckElems, in.dtype(), op, c.tag, c.timeout);
  });
  std::vector<char> check(region.size());
  copy_bytes(check.data(), cpu, reduced + bytes, dev, check.size());
  if (!detail::check_region_holds(check.data(), c.word, in.dtype(), op)) reduction_mismatch(c);
  copy_bytes(out.raw_data(), dev, reduced, dev, bytes);
  return out;
}

Tensor ProcessGroup::all_to_all(const Tensor& t, CallOptions o, Site site) {
  Tensor in = contiguous_input("all_to_all", t);
  if (in.dim() == 0 || in.size(0) % size_ != 0)
    throw std::invalid_argument("[dist::all_to_all] dim 0 must be a multiple of the world size " +
                                std::to_string(size_) + ", got shape " + shape_str(in.shape()));
  // Gloo cuts the bytes into N equal blocks: each must be whole units.
  check_whole_units("all_to_all", in.dtype(), std::vector<int64_t>(size_, in.numel() / size_),
                    row_elems_of(in));
  Call c = begin("all_to_all", &in, detail::kSameShape, ReduceOp::sum, -1, o, site);
  NoGradGuard g;
  if (size_ == 1) return in.clone();
  Tensor out = quanta::detail::make_tensor(in.shape(), in.dtype(), in.device());
  if (!checked() || in.nbytes() == 0 || !inline_check(in.nbytes())) {
    auto run = [&] {
      backend_for(in, c.timeout)
          .all_to_all(in.raw_data(), out.raw_data(), in.nbytes(), c.tag, c.timeout);
    };
    if (checked() && in.nbytes() != 0)
      run_beside_ring_check(c, run);
    else
      guarded(c, run);
    return out;
  }
  // Every block travels with the sender's fingerprint: [N blocks in | N out].
  const Device dev = in.device(), cpu = Device::cpu();
  const auto n = static_cast<std::size_t>(size_);
  const std::size_t bytes = in.nbytes() / n, block = bytes + sizeof(Fingerprint);
  const Tensor stage = staging(2 * n * block, dev);
  char* s = static_cast<char*>(stage.raw_data());
  char* got = s + n * block;
  const char* from = static_cast<const char*>(in.raw_data());
  for (std::size_t j = 0; j < n; ++j) {
    copy_bytes(s + j * block, dev, from + j * bytes, dev, bytes);
    copy_bytes(s + j * block + bytes, dev, &c.fp, cpu, sizeof(Fingerprint));
  }
  guarded(c, [&] { backend_for(in, c.timeout).all_to_all(s, got, n * block, c.tag, c.timeout); });
  std::vector<Fingerprint> fps(n);
  for (std::size_t j = 0; j < n; ++j)
    copy_bytes(&fps[j], cpu, got + j * block + bytes, dev, sizeof(Fingerprint));
  if (const std::string diff = detail::compare(fps); !diff.empty()) mismatch(c, diff);
  char* result = static_cast<char*>(out.raw_data());
  for (std::size_t j = 0; j < n; ++j)
    copy_bytes(result + j * bytes, dev, got + j * block, dev, bytes);
  return out;
}

void ProcessGroup::barrier(CallOptions o, Site site) {
  Call c = begin("barrier", nullptr, detail::kNoTensor, ReduceOp::sum, -1, o, site);
  if (size_ == 1) return;
  if (!checked()) {
    guarded(c, [&] { gloo_->barrier(c.tag, c.timeout); });
    return;
  }
  // An all-to-all of fingerprints is a barrier (no rank hears from all the
  // others before all have arrived) that also compares the calls.
  std::vector<Fingerprint> mine(size_, c.fp), fps(size_);
  guarded(c, [&] {
    gloo_->all_to_all(mine.data(), fps.data(), sizeof(Fingerprint) * mine.size(), c.tag, c.timeout);
  });
  if (const std::string diff = detail::compare(fps); !diff.empty()) mismatch(c, diff);
}

}  // namespace quanta::dist
