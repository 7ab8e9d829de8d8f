#include "dist/sharded_units.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/random/generator.h"
#include "engine/serial_worker.h"

namespace quanta::dist {
namespace {

constexpr std::size_t kNone = static_cast<std::size_t>(-1);

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

uint64_t hash_bytes(const Tensor& t) {
  const Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
  return quanta::detail::fnv1a64(
      std::string_view(static_cast<const char*>(host.raw_data()), host.nbytes()));
}

// Points `t` (every handle sharing its TensorImpl: the module's member and
// its registry entry) at `storage`, contiguous from its start.
void point_at(const Tensor& t, std::shared_ptr<Storage> storage) {
  TensorImpl* impl = t.impl();
  impl->storage = std::move(storage);
  impl->offset = 0;
}

}  // namespace

struct ShardedUnits::State {
  struct Unit {
    std::string name;
    Module* module = nullptr;
    int hook_id = -1;
    std::vector<Tensor> tensors;     // the module's own handles
    std::vector<std::string> names;  // theirs, in full
    std::vector<std::size_t> offsets;
    std::size_t bytes = 0;        // laid end to end, granules included
    std::size_t shard_bytes = 0;  // per rank
    Tensor shard;                 // this rank's, u8 [shard_bytes]
    int depth = 0;                // forwards running (1 but for nesting)
  };
  // A gather posted to the communication thread; `data` is filled there.
  struct Pending {
    std::size_t unit = kNone;
    std::shared_ptr<std::vector<Tensor>> data;
  };

  ShardOptions options;
  Module* root = nullptr;
  ProcessGroup* origin = nullptr;  // the caller's group: shard()'s checks
  int group_size = 1, group_rank = 0;
  std::set<std::string> connected;  // devices whose transport is made
  std::deque<Unit> units;           // shard() appends without moving those before
  std::vector<std::string> names;
  std::size_t full = 0, kept = 0;
  std::shared_ptr<ProcessGroup> group;  // own connections, used from `comm`
  std::unique_ptr<quanta::detail::SerialWorker> comm;
  std::deque<Pending> pending;  // at most two, oldest first
  std::size_t last = kNone;
  int direction = 1;
  bool sharded = true;
  std::atomic<uint64_t> gathered{0}, gathers{0}, hits{0};

  explicit State(ShardOptions o) : options(o) {}

  Unit lay_out(const std::string& name, std::string& layout);
  void check_same(ProcessGroup& on, const std::vector<Unit>& laid, const std::string& layout);
  void take_shard(Unit&& laid, const std::shared_ptr<State>& self);

  // All-gathers unit u's shards into fresh storage per tensor (runs on the
  // communication thread).
  std::vector<Tensor> gather(const Unit& u) {
    NoGradGuard no_grad;
    Tensor all;
    try {
      all = group->all_gather(u.shard);
    } catch (const DistError& e) {
      throw DistError("[ShardedUnits] gathering unit '" + u.name + "': " + e.what());
    }
    const Device dev = all.device();
    const char* base = static_cast<const char*>(all.raw_data());
    std::vector<Tensor> out;
    for (std::size_t k = 0; k < u.tensors.size(); ++k) {
      const Tensor& t = u.tensors[k];
      Tensor fresh = quanta::detail::make_tensor(t.shape(), t.dtype(), dev);
      copy_bytes(fresh.raw_data(), dev, base + u.offsets[k], dev, fresh.nbytes());
      out.push_back(std::move(fresh));
    }
    return out;
  }

  // Counted here, on the poster's thread: the counts are the same whenever
  // they are read, however far the communication thread has got.
  void post_gather(std::size_t i) {
    gathered += units[i].bytes;
    ++gathers;
    Pending p{i, std::make_shared<std::vector<Tensor>>()};
    comm->post([this, i, data = p.data] { *data = gather(units[i]); });
    pending.push_back(std::move(p));
  }

  // Unit i's gathered tensors: prefetched, or gathered now.
  std::vector<Tensor> take(std::size_t i) {
    auto it =
        std::find_if(pending.begin(), pending.end(), [i](const Pending& p) { return p.unit == i; });
    const bool hit = it != pending.end();
    if (!hit) {
      post_gather(i);
      it = std::prev(pending.end());
    }
    comm->drain();  // rethrows a failed gather
    std::vector<Tensor> data = std::move(*it->data);
    pending.erase(it);
    if (hit) ++hits;
    return data;
  }

  void install(Unit& u, const std::vector<Tensor>& data) {
    for (std::size_t k = 0; k < u.tensors.size(); ++k) point_at(u.tensors[k], data[k].storage());
  }

  void release(Unit& u) {
    for (const Tensor& t : u.tensors) point_at(t, std::make_shared<Storage>(0, t.device()));
  }

  // The unit expected after unit i: onwards in the direction the last two
  // took, turning back at either end (a repeat means the backward started).
  std::size_t guess_next(std::size_t i) {
    if (last == kNone || i > last)
      direction = 1;
    else if (i < last)
      direction = -1;
    else
      direction = -direction;
    last = i;
    const auto inside = [&](int64_t j) { return j >= 0 && j < int64_t(units.size()); };
    int64_t j = int64_t(i) + direction;
    if (!inside(j)) j = int64_t(i) - direction;
    return inside(j) ? std::size_t(j) : kNone;
  }

  void prefetch(std::size_t j) {
    if (j == kNone || units[j].depth > 0) return;
    for (const Pending& p : pending)
      if (p.unit == j) return;
    if (pending.size() >= 2) pending.pop_front();  // a guess that did not come true
    post_gather(j);
  }

  void before(std::size_t i) {
    Unit& u = units[i];
    if (u.depth++ > 0) return;
    try {
      install(u, take(i));
    } catch (...) {
      --u.depth;
      throw;
    }
    if (options.prefetch) prefetch(guess_next(i));
  }

  void after(std::size_t i) {
    Unit& u = units[i];
    if (--u.depth > 0) return;
    release(u);
  }

  void remove_hooks() {
    for (Unit& u : units)
      if (u.hook_id >= 0) {
        u.module->remove_forward_hooks(u.hook_id);
        u.hook_id = -1;
      }
  }
};

namespace {

// The refusal of units `a` and `b` that are the same or nest, or nothing.
std::optional<std::string> overlap(const std::string& a, const std::string& b) {
  if (a == b) return "[ShardedUnits] unit '" + a + "' is listed twice";
  const auto inside = [](const std::string& inner, const std::string& outer) {
    return inner.rfind(outer + ".", 0) == 0;
  };
  if (inside(a, b) || inside(b, a)) {
    const std::string& inner = inside(a, b) ? a : b;
    const std::string& outer = inside(a, b) ? b : a;
    return "[ShardedUnits] unit '" + inner + "' is inside unit '" + outer +
           "'; list either, not both";
  }
  return std::nullopt;
}

void check_granule(const ShardOptions& options) {
  if (options.granule_bytes == 0 || (options.granule_bytes & (options.granule_bytes - 1)) != 0)
    throw std::invalid_argument("[ShardedUnits] granule_bytes must be a power of two, got " +
                                std::to_string(options.granule_bytes));
}

}  // namespace

// Unit `name` of `root` laid out, not yet cut; its layout lines (names,
// dtypes, shapes) added to `layout`. Refuses a name that is not a module,
// or one inside (or around) a unit already sharded.
ShardedUnits::State::Unit ShardedUnits::State::lay_out(const std::string& name,
                                                       std::string& layout) {
  for (const Unit& other : units)
    if (const auto refusal = overlap(name, other.name)) throw std::invalid_argument(*refusal);
  Module* module = nullptr;
  for (auto& [n, m] : root->named_modules())
    if (n == name) module = m;
  if (!module || name.empty())
    throw std::invalid_argument("[ShardedUnits] no module named '" + name + "' to shard");
  Unit u;
  u.name = name;
  u.module = module;
  for (auto& [tname, t] : u.module->named_buffers()) {
    if (!t.is_contiguous() || t.offset() != 0)
      throw std::invalid_argument("[ShardedUnits] buffer '" + name + "." + tname +
                                  "' is a view; only whole contiguous buffers are sharded");
    u.offsets.push_back(u.bytes);
    u.bytes = round_up(u.bytes + t.nbytes(), options.granule_bytes);
    u.tensors.push_back(t);
    u.names.push_back(name + "." + tname);
    layout += u.names.back() + " " + dtype_name(t.dtype()) + " " + shape_str(t.shape()) + "\n";
  }
  u.shard_bytes = round_up((u.bytes + group_size - 1) / group_size, options.granule_bytes);
  return u;
}

// Every rank must shard the same bytes: the layout first, then each
// tensor's bytes, as hashes. Collective on `on`.
void ShardedUnits::State::check_same(ProcessGroup& on, const std::vector<Unit>& laid,
                                     const std::string& layout) {
  const int n = on.size();
  std::vector<int64_t> hashes{int64_t(quanta::detail::fnv1a64(layout))};
  const auto gather_hashes = [&](const std::vector<int64_t>& mine) {
    return on.all_gather(from_vector<int64_t>(mine, {int64_t(mine.size())})).to_vector<int64_t>();
  };
  const std::vector<int64_t> layouts = gather_hashes(hashes);
  for (int q = 1; q < n; ++q)
    if (layouts[q] != layouts[0])
      throw DistError("[ShardedUnits] rank " + std::to_string(q) +
                      " shards other tensors than rank 0 (names, dtypes or shapes differ)");
  hashes.clear();
  std::vector<const std::string*> tensor_names;
  for (const Unit& u : laid)
    for (std::size_t k = 0; k < u.tensors.size(); ++k) {
      hashes.push_back(int64_t(hash_bytes(u.tensors[k])));
      tensor_names.push_back(&u.names[k]);
    }
  if (hashes.empty()) return;
  const std::vector<int64_t> all = gather_hashes(hashes);
  const std::size_t k = hashes.size();
  std::ostringstream diff;
  int shown = 0;
  for (std::size_t i = 0; i < k && shown < 5; ++i) {
    std::string ranks;
    for (int q = 1; q < n; ++q)
      if (all[q * k + i] != all[i]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
    if (ranks.empty()) continue;
    diff << "\n  '" << *tensor_names[i] << "': rank " << ranks << " differ from rank 0";
    ++shown;
  }
  if (shown > 0)
    throw DistError("[ShardedUnits] the ranks hold different bytes for the tensors to shard" +
                    diff.str());
}

// Keeps this rank's bytes of laid-out unit `u`, empties the module's
// tensors, and hooks its forward.
void ShardedUnits::State::take_shard(Unit&& laid, const std::shared_ptr<State>& self) {
  Unit& u = units.emplace_back(std::move(laid));
  for (const std::string& n : u.names) names.push_back(n);
  full += u.bytes;
  kept += u.shard_bytes;
  const Device dev = u.tensors[0].device();
  u.shard = zeros({int64_t(u.shard_bytes)}, {.dtype = DType::u8, .device = dev});
  const std::size_t lo = std::size_t(group_rank) * u.shard_bytes, hi = lo + u.shard_bytes;
  char* dst = static_cast<char*>(u.shard.raw_data());
  for (std::size_t k = 0; k < u.tensors.size(); ++k) {
    const Tensor& t = u.tensors[k];
    const std::size_t a = std::max(lo, u.offsets[k]);
    const std::size_t b = std::min(hi, u.offsets[k] + t.nbytes());
    if (a < b)
      copy_bytes(dst + (a - lo), dev, static_cast<const char*>(t.raw_data()) + (a - u.offsets[k]),
                 t.device(), b - a);
  }
  release(u);
  // Its NCCL communicator now, on this thread, not at the first gather on
  // the worker thread.
  if (connected.insert(dev.str()).second) group->connect(dev);
  const std::size_t i = units.size() - 1;
  std::weak_ptr<State> weak = self;
  u.hook_id = u.module->add_forward_hooks(
      [weak, i](Module&) {
        if (auto s = weak.lock()) s->before(i);
      },
      [weak, i](Module&) {
        if (auto s = weak.lock()) s->after(i);
      });
}

ShardedUnits::ShardedUnits(Module& root, ProcessGroup& group, ShardOptions options)
    : state_(std::make_shared<State>(options)) {
  check_granule(options);
  State& st = *state_;
  st.root = &root;
  st.origin = &group;
  st.group_size = group.size();
  st.group_rank = group.rank();
  st.group = group.clone("shard");
  st.comm = std::make_unique<quanta::detail::SerialWorker>();
}

ShardedUnits::ShardedUnits(Module& root, ProcessGroup& group, std::vector<std::string> units,
                           ShardOptions options)
    : ShardedUnits(root, group, options) {
  State& st = *state_;
  // Every unit laid out and checked before any is cut: a refusal leaves
  // the module whole.
  for (std::size_t i = 0; i < units.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (const auto refusal = overlap(units[i], units[j])) throw std::invalid_argument(*refusal);
  std::vector<State::Unit> laid;
  std::string layout;
  for (const std::string& name : units) {
    State::Unit u = st.lay_out(name, layout);
    if (!u.tensors.empty()) laid.push_back(std::move(u));  // nothing to shard: it runs as it is
  }
  st.check_same(group, laid, layout);
  for (State::Unit& u : laid) st.take_shard(std::move(u), state_);
}

void ShardedUnits::shard(const std::string& unit) {
  State& st = *state_;
  if (!st.sharded) throw std::logic_error("[ShardedUnits] shard('" + unit + "') after unshard()");
  std::string layout;
  State::Unit u = st.lay_out(unit, layout);
  if (u.tensors.empty()) return;
  st.check_same(*st.origin, {u}, layout);
  st.take_shard(std::move(u), state_);
}

std::vector<std::string> ShardedUnits::unit_names() const {
  std::vector<std::string> out;
  for (const State::Unit& u : state_->units) out.push_back(u.name);
  return out;
}

ShardedUnits::~ShardedUnits() {
  State& st = *state_;
  st.remove_hooks();
  try {
    st.comm->drain();
  } catch (...) {
    // A failed prefetch nobody waited for: the group reported it already.
  }
}

void ShardedUnits::unshard() {
  State& st = *state_;
  if (!st.sharded) return;
  for (std::size_t i = 0; i < st.units.size(); ++i)
    if (st.units[i].depth == 0) st.install(st.units[i], st.take(i));
  st.pending.clear();
  st.remove_hooks();
  for (State::Unit& u : st.units) u.shard = Tensor();
  st.sharded = false;
}

bool ShardedUnits::sharded() const { return state_->sharded; }
const std::vector<std::string>& ShardedUnits::tensor_names() const { return state_->names; }
std::size_t ShardedUnits::full_bytes() const { return state_->full; }
std::size_t ShardedUnits::shard_bytes() const { return state_->kept; }
uint64_t ShardedUnits::gathered_bytes() const { return state_->gathered; }
uint64_t ShardedUnits::gathers() const { return state_->gathers; }
uint64_t ShardedUnits::prefetch_hits() const { return state_->hits; }

}  // namespace quanta::dist
