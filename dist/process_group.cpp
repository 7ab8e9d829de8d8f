// ProcessGroup: call bookkeeping (sequence numbers, tags, deadlines), the
// debug fingerprint check, failure reports, and the collectives: tensors are
// checked and staged here, the bytes move through the backend of their
// device (backend_for: Gloo for CPU tensors, NCCL for CUDA tensors).
#include "dist/process_group.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "dist/backend.h"
#include "dist/fingerprint.h"
#include "dist/gloo_backend.h"
#include "dist/group_call.h"
#include "dist/nccl_backend.h"
#include "dist/reduce_kernels.h"
#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/random/generator.h"

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

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0 && std::strcmp(v, "false") != 0;
}

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
  // Tell peers still waiting on us that we left on purpose (fail() reads it).
  if (store_ && broken_.empty()) {
    try {
      store_->set_string("status/" + std::to_string(rank_),
                         "left the group after " + std::to_string(seq_) + " collectives");
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
  if (!t.device().is_cuda()) return *gloo_;
  if (!nccl_) {
    // One communicator per group, on the device of its first CUDA tensor;
    // its keys live under the group's store.
    const int index = t.device().index;
    PrefixStore s("nccl." + std::to_string(index), store_);
    nccl_ = std::make_unique<detail::NcclBackend>(s, rank_, size_, index, init_timeout);
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
  c.desc = detail::describe(c.fp);
  if (!broken_.empty())
    throw DistError("[dist] " + c.desc + " on rank " + std::to_string(rank_) +
                    ": the group is broken by an earlier failure: " + broken_);
  if (t && t->defined() && t->device().is_cuda() && !cuda_built())
    throw std::invalid_argument("[dist::" + std::string(op) +
                                "] CUDA tensor, but quanta was built without CUDA");
  ++seq_;
  c.tag = detail::tag_of(c.fp);
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
  throw DistError("[dist] " + call.desc + " on rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + ": " + broken_);
}

void ProcessGroup::fail(const Call& call, const std::string& what) {
  const auto waited = std::chrono::duration_cast<Millis>(Clock::now() - call.start).count();
  std::ostringstream msg;
  msg << "[dist] " << call.desc << " failed on rank " << rank_ << " of " << size_ << " after "
      << waited << " ms: " << what;
  broken_ = msg.str();  // from now on every call fails at once
  // Ask the peers what they were doing: each failing rank posts its call,
  // ranks that left on purpose posted that; the rest did not arrive.
  std::vector<std::string> reports(size_);
  const Millis grace = std::clamp(call.timeout / 2, Millis(300), Millis(2000));
  try {
    store_->set_string("status/" + std::to_string(rank_), call.desc);
    const auto deadline = Clock::now() + grace;
    for (;;) {
      bool all = true;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_ || !reports[r].empty()) continue;
        if (store_->check("status/" + std::to_string(r)))
          reports[r] = store_->get_string("status/" + std::to_string(r), Millis(1000));
        else
          all = false;
      }
      if (all || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(Millis(20));
    }
  } catch (const std::exception& e) {
    msg << "\n  (could not ask the other ranks: " << e.what() << ")";
    broken_ = msg.str();
    throw DistError(broken_);
  }
  const std::string mine = call.desc.substr(0, call.desc.find(" at "));
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const std::string& rep = reports[r];
    if (rep.empty())
      missing.push_back(r);
    else if (rep.rfind("left", 0) == 0)
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
  const bool fuse =
      debug_ && size_ > 1 && t.defined() && t.device().is_cpu() && t.nbytes() <= kDebugPayload;
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
  guarded(c, [&] {
    backend_for(buf, c.timeout).all_reduce(buf.raw_data(), n, buf.dtype(), op, c.tag, c.timeout);
  });
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
  guarded(c, [&] {
    backend_for(buf, c.timeout).broadcast(buf.raw_data(), buf.nbytes(), root, c.tag, c.timeout);
  });
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
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .all_gather(in.raw_data(), out.raw_data(), in.nbytes(), c.tag, c.timeout);
  });
  return out;
}

Tensor ProcessGroup::all_gather_v(const Tensor& t, std::vector<int64_t>* sizes, CallOptions o,
                                  Site site) {
  if (t.defined() && t.device().is_cuda()) {
    // NCCL has no gather of uneven pieces (NcclBackend refuses it until
    // grouped send/recv, issue 18): the bytes travel through the group's
    // Gloo transport and come back to the tensor's device.
    NoGradGuard g;
    return all_gather_v(t.to(Device::cpu()), sizes, o, site).to(t.device());
  }
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
  // First the first dims (the tag already covers dtype and the other dims).
  int64_t mine = in.size(0);
  guarded(c, [&] {
    gloo_->all_gather(&mine, counts.data(), sizeof mine, sub_tag(c.tag, 1), c.timeout);
  });
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
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .reduce_scatter(in.raw_data(), out.raw_data(), static_cast<std::size_t>(out.numel()),
                        in.dtype(), op, c.tag, c.timeout);
  });
  return out;
}

Tensor ProcessGroup::all_to_all(const Tensor& t, CallOptions o, Site site) {
  if (t.defined() && t.device().is_cuda()) {
    // Through the group's Gloo transport, as all_gather_v (NcclBackend
    // refuses all_to_all until grouped send/recv, issue 18).
    NoGradGuard g;
    return all_to_all(t.to(Device::cpu()), o, site).to(t.device());
  }
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
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .all_to_all(in.raw_data(), out.raw_data(), in.nbytes(), c.tag, c.timeout);
  });
  return out;
}

void ProcessGroup::barrier(CallOptions o, Site site) {
  Call c = begin("barrier", nullptr, detail::kNoTensor, ReduceOp::sum, -1, o, site);
  if (size_ == 1) return;
  guarded(c, [&] { gloo_->barrier(c.tag, c.timeout); });
}

}  // namespace quanta::dist
