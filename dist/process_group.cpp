// ProcessGroup's lifecycle and call bookkeeping: rendezvous, clones, the
// backend of each device, sequence numbers, tags and deadlines, and the
// failure report. The collectives are in dist/collectives.cpp, the checks
// that the ranks made the same call in dist/call_checks.cpp.
#include "dist/process_group.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <unordered_map>

#include "dist/backend/backend.h"
#include "dist/backend/gloo_backend.h"
#include "dist/backend/nccl_backend.h"
#include "dist/call_checks.h"
#include "dist/env.h"
#include "dist/fingerprint.h"
#include "dist/group_call.h"
#include "dist/store/rendezvous.h"
#include "engine/device_backend.h"
#include "engine/sim/sim_stream.h"

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

}  // namespace

namespace {

// Should this process be killed, the store posts its status for it, and a
// peer's fail() names it at once rather than after the report's grace.
void leave_will(Store& store, int rank) {
  const std::string died = "died: its process ended (killed, or exited) without leaving the group";
  store.set_will(detail::status_key(rank), Bytes(died.begin(), died.end()));
}

// A CallProfile's row of collective `op` (its fingerprint's op index) on
// tensors of t's device type: "dist.all_reduce" (engine/profile/).
profile::EntryCounter* profiled_collective(int32_t index, const char* op, const Tensor* t) {
  constexpr int32_t kOps = 16;
  static profile::EntryCounter rows[3][kOps];
  const DeviceType type = t && t->defined() ? t->device().type : DeviceType::cpu;
  const auto d = static_cast<std::size_t>(type);
  if (index < 0 || index >= kOps || d >= 3) return nullptr;
  profile::EntryCounter& c = rows[d][index];
  if (!c.listed.load(std::memory_order_acquire)) profile::enlist(c, type, "dist", op);
  return &c;
}

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size, GroupOptions opts)
    : rank_(rank),
      size_(size),
      opts_(std::move(opts)),
      stream_calls_(std::make_shared<detail::StreamCalls>()),
      checks_(std::make_unique<Checks>(*this)) {
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
      store_->set_string(detail::status_key(rank_),
                         "left the group after " + std::to_string(seq_) + " collectives");
    } catch (...) {
    }
  }
  if (store_) {
    try {
      store_->clear_will(detail::status_key(rank_));
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
  return backend_for(t.device(), init_timeout);
}

detail::Backend& ProcessGroup::backend_for(Device device, Millis init_timeout) {
  if (!device.is_cuda()) return *gloo_;
  if (!nccl_) {
    // One communicator per group, on the device of its first CUDA tensor;
    // its keys live under the group's store.
    const int index = device.index;
    PrefixStore s("nccl." + std::to_string(index), store_);
    nccl_ = detail::make_nccl_backend(s, rank_, size_, index, init_timeout);
  }
  return *nccl_;
}

void ProcessGroup::connect(Device device) {
  if (size_ == 1 || !device.is_cuda()) return;
  if (!cuda_built())
    throw std::invalid_argument("[dist::connect] " + device.str() +
                                ", but quanta was built without CUDA");
  backend_for(device, opts_.timeout);
}

// ---- call bookkeeping ----

ProcessGroup::Call ProcessGroup::begin(const char* op, const Tensor* t, int shape_rule,
                                       ReduceOp rop, int root, const CallOptions& o,
                                       const Site& site, bool exchange_fingerprints) {
  const bool reduces = std::strcmp(op, "all_reduce") == 0 ||
                       std::strcmp(op, "reduce_scatter") == 0 || std::strcmp(op, "reduce") == 0;
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
  if (profile::active()) c.profiled = profile::SideCall(profiled_collective(c.fp.op, op, t));
  if (size_ > 1 && debug_ && exchange_fingerprints) checks_->fingerprints_before(c);
  return c;
}

void ProcessGroup::fail(const Call& call, const std::string& what) {
  const auto waited = std::chrono::duration_cast<Millis>(Clock::now() - call.start).count();
  std::ostringstream msg;
  msg << "[dist] " << call.desc() << " failed on rank " << rank_ << " of " << size_ << " after "
      << waited << " ms: " << what;
  broken_ = msg.str();  // from now on every call fails at once
  // Ask the peers what they were doing: each failing rank posts its call,
  // ranks that left on purpose posted that; the rest did not arrive.
  std::vector<std::string> reports(size_);
  const Millis grace = detail::grace_of(call.timeout);
  try {
    store_->set_string(detail::status_key(rank_), call.desc());
    // A survivor blocked on an exchange with this rank would otherwise wait
    // for it until its own timeout: it learns of the failure now, and posts.
    if (gloo_) gloo_->close_connections();
    const auto posts = detail::await_posts(*store_, rank_, size_, "status/", grace);
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

}  // namespace quanta::dist
