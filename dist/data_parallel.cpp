#include "dist/data_parallel.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "dist/backend/nccl_backend.h"
#include "engine/autograd/grad_mode.h"
#include "engine/cuda/runtime.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/random/generator.h"
#include "engine/serial_worker.h"
#include "engine/sim/sim_stream.h"

namespace quanta::dist {
namespace {

std::string describe_tensors(const std::vector<std::pair<std::string, Tensor>>& named,
                             const char* kind) {
  std::string s;
  for (const auto& [name, t] : named)
    s += std::string(kind) + " '" + name + "' " + dtype_name(t.dtype()) + " " +
         shape_str(t.shape()) + "\n";
  return s;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

}  // namespace

struct DataParallel::State {
  struct Slot {
    std::string name;
    Tensor param;
    int owner = -1;  // the rank that keeps its gradient; -1: every rank
    int bucket = 0;
    int64_t offset = 0;
    bool ready = false;
  };
  struct Bucket {
    Tensor flat;  // allocated on first use; dropped between steps when another rank owns it
    Device device;
    int64_t numel = 0;
    int owner = -1;
    std::vector<int> slots;
    int pending = 0;
  };
  std::vector<Slot> slots;  // reverse registration order
  std::vector<Bucket> buckets;
  std::vector<std::pair<std::string, Tensor>> buffers;
  std::size_t next_launch = 0;
  int no_sync_depth = 0;
  std::shared_ptr<ProcessGroup> grads;                 // own connections, used from the comm thread
  std::unique_ptr<quanta::detail::SerialWorker> comm;  // bucket reductions, in order

  // Slots in order into buckets: a new one when the dtype or the owner
  // changes or the bucket would pass `cap` bytes.
  void assign_buckets(std::size_t cap) {
    buckets.clear();
    std::size_t used = 0;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      Slot& s = slots[i];
      const std::size_t bytes = s.param.nbytes();
      bool fresh = buckets.empty();
      if (!fresh) {
        const Slot& last = slots[buckets.back().slots.back()];
        fresh =
            last.param.dtype() != s.param.dtype() || last.owner != s.owner || used + bytes > cap;
      }
      if (fresh) {
        // On the parameters' device: gradients are copied in on the device
        // and the backend reduces them there (NCCL for CUDA), no host trip.
        buckets.push_back(Bucket{{}, s.param.device(), 0, s.owner, {}, 0});
        used = 0;
      }
      Bucket& b = buckets.back();
      s.bucket = static_cast<int>(buckets.size() - 1);
      s.offset = b.numel;
      b.numel += s.param.numel();
      b.slots.push_back(static_cast<int>(i));
      b.pending = static_cast<int>(b.slots.size());
      used += bytes;
    }
  }

  // Whether `owner` (a slot's or a bucket's) is another rank: this rank
  // hands those gradients over and keeps none of them.
  bool owned_elsewhere(int owner) const { return owner >= 0 && owner != grads->rank(); }

  Tensor& flat_of(Bucket& b) {
    if (!b.flat.defined())
      b.flat = quanta::detail::make_tensor({b.numel}, slots[b.slots[0]].param.dtype(), b.device);
    return b.flat;
  }

  // A full bucket's reduction goes to the communication thread: an average
  // on every rank, or into its owner. On a GPU its gradient copies are only
  // queued yet: an event recorded now, after them, is what the NCCL
  // reduction waits for, so it overlaps the backward kernels the main
  // thread queues from here on (nccl_backend.h). On sim the same: Gloo
  // starts when the stream passes the event.
  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      Bucket& b = buckets[next_launch++];
      Tensor flat = flat_of(b);
      const int owner = b.owner;
      ProcessGroup* g = grads.get();
      std::shared_ptr<void> ready;
      if (flat.device().is_cuda()) ready = cuda::record_event(flat.device().index);
      if (flat.device().is_sim())
        ready = std::make_shared<sim::Event>(sim::record_event(flat.device().index));
      comm->post([g, flat, owner, ready] {
        const detail::ReadyAfter after(ready.get());
        if (owner < 0)
          g->all_reduce(flat, ReduceOp::avg);
        else
          g->reduce(flat, owner, ReduceOp::avg);
      });
    }
  }

  void on_gradient(int index) {
    if (no_sync_depth > 0) return;
    Slot& s = slots[index];
    if (s.ready)
      throw std::invalid_argument("[DataParallel] parameter '" + s.name +
                                  "' received a second gradient in one step: call finish_step() "
                                  "after each backward, or accumulate inside no_sync()");
    Bucket& b = buckets[s.bucket];
    NoGradGuard g;
    copy_(flat_of(b).narrow(0, s.offset, s.param.numel()),
          s.param.grad().reshape({s.param.numel()}));
    // Another rank keeps this gradient: this rank's copy is in the bucket.
    if (owned_elsewhere(s.owner)) s.param.set_grad(Tensor());
    s.ready = true;
    if (--b.pending == 0) launch_ready();
  }
};

DataParallel::DataParallel(std::shared_ptr<Module> module, ProcessGroup& group,
                           DataParallelOptions opts)
    : module_(std::move(module)),
      group_(group),
      opts_(std::move(opts)),
      state_(std::make_shared<State>()) {
  if (!module_) throw std::invalid_argument("[DataParallel] null module");
  if (opts_.sharded_units) {
    const std::vector<std::string> made = opts_.sharded_units->unit_names();
    if (!opts_.shard_units.empty() && opts_.shard_units != made)
      throw std::invalid_argument(
          "[DataParallel] shard_units names other units than sharded_units holds (give one or "
          "the other)");
    opts_.shard_units = made;
  }
  const std::set<std::string> ignore(opts_.ignore.begin(), opts_.ignore.end());
  std::vector<std::pair<std::string, Tensor>> params, all_params;
  for (auto& [name, p] : module_->named_parameters()) {
    if (ignore.count(name)) continue;
    all_params.emplace_back(name, p);
    if (p.requires_grad()) params.emplace_back(name, p);
  }
  // Buffers inside a sharded unit are checked like the others but never
  // broadcast: ShardedUnits compares their bytes and keeps 1/N of them.
  const auto sharded_buffer = [&](const std::string& name) {
    return std::any_of(opts_.shard_units.begin(), opts_.shard_units.end(),
                       [&](const std::string& u) { return name.rfind(u + ".", 0) == 0; });
  };
  std::vector<std::pair<std::string, Tensor>> all_buffers;
  for (auto& [name, b] : module_->named_buffers()) {
    if (ignore.count(name)) continue;
    all_buffers.emplace_back(name, b);
    if (!sharded_buffer(name)) state_->buffers.emplace_back(name, b);
  }
  if (!opts_.shard_units.empty() && opts_.broadcast_buffers && !state_->buffers.empty())
    throw std::invalid_argument(
        "[DataParallel] broadcast_buffers with shard_units: buffer '" + state_->buffers[0].first +
        "' is outside the sharded units, and reloading it would read the sharded ones; turn "
        "broadcast_buffers off or shard every module that holds buffers");

  // 1. Same names, shapes and dtypes everywhere (a hash first, the full
  //    lists only when the hashes differ).
  const std::string desc =
      describe_tensors(all_params, "parameter") + describe_tensors(all_buffers, "buffer");
  Tensor hash = from_vector<int64_t>({int64_t(quanta::detail::fnv1a64(desc))}, {1});
  const auto hashes = group.all_gather(hash).to_vector<int64_t>();
  if (std::adjacent_find(hashes.begin(), hashes.end(), std::not_equal_to<>()) != hashes.end()) {
    Tensor bytes = from_blob(desc.data(), {int64_t(desc.size())}, DType::u8, {.dtype = DType::u8});
    std::vector<int64_t> sizes;
    Tensor all = group.all_gather_v(bytes, &sizes);
    const char* base = static_cast<const char*>(all.raw_data());
    std::vector<std::string> descs;
    for (int64_t r = 0, off = 0; r < group.size(); off += sizes[r++])
      descs.emplace_back(base + off, sizes[r]);
    const auto ref = lines_of(descs[0]);
    std::ostringstream msg;
    msg << "[DataParallel] the ranks hold different models:";
    for (int r = 1; r < group.size(); ++r) {
      const auto other = lines_of(descs[r]);
      for (std::size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
        const std::string a = i < ref.size() ? ref[i] : "(nothing)";
        const std::string b = i < other.size() ? other[i] : "(nothing)";
        if (a == b) continue;
        msg << "\n  first difference between rank 0 and rank " << r << ": rank 0 has " << a
            << ", rank " << r << " has " << b;
        break;
      }
    }
    throw DistError(msg.str());
  }
  // 2. Rank 0's values everywhere, as bytes.
  for (auto& [name, p] : all_params) group.broadcast(p, 0);
  for (auto& [name, b] : state_->buffers) group.broadcast(b, 0);
  module_->reload_host_state();
  if (opts_.sharded_units)
    sharded_ = opts_.sharded_units;
  else if (!opts_.shard_units.empty())
    sharded_ = std::make_shared<ShardedUnits>(*module_, group, opts_.shard_units, opts_.shard);

  // 3. Buckets in reverse registration order (gradients arrive roughly in
  //    reverse), one dtype per bucket, at most bucket_bytes each.
  State& st = *state_;
  for (auto it = params.rbegin(); it != params.rend(); ++it)
    st.slots.push_back(State::Slot{it->first, it->second});
  st.assign_buckets(opts_.bucket_bytes);
  st.grads = group.clone("dp");
  // Its NCCL communicators now, on this thread, not mid-backward on the
  // comm thread.
  for (const State::Bucket& b : st.buckets) st.grads->connect(b.device);
  st.comm = std::make_unique<quanta::detail::SerialWorker>();
  for (std::size_t i = 0; i < st.slots.size(); ++i) {
    std::weak_ptr<State> weak = state_;
    st.slots[i].param.register_post_accumulate_hook([weak, i](const Tensor&) {
      if (auto s = weak.lock()) s->on_gradient(int(i));
    });
  }
}

DataParallel::~DataParallel() = default;

std::size_t DataParallel::num_buckets() const { return state_->buckets.size(); }

Device DataParallel::bucket_device(std::size_t i) const { return state_->buckets.at(i).device; }

int DataParallel::bucket_owner(std::size_t i) const { return state_->buckets.at(i).owner; }

void DataParallel::reduce_gradients_to_owners(const std::function<int(const Tensor&)>& owner) {
  State& st = *state_;
  const bool mid_step =
      st.next_launch != 0 ||
      std::any_of(st.slots.begin(), st.slots.end(), [](const State::Slot& s) { return s.ready; });
  if (mid_step)
    throw std::invalid_argument(
        "[DataParallel] reduce_gradients_to_owners during a step: call it before a backward or "
        "after finish_step()");
  for (State::Slot& s : st.slots) {
    const int r = owner(s.param);
    if (r < -1 || r >= group_.size())
      throw std::invalid_argument("[DataParallel] the owner of parameter '" + s.name + "' is " +
                                  std::to_string(r) + ", outside a world of " +
                                  std::to_string(group_.size()) + " (or -1 for every rank)");
    s.owner = r;
  }
  st.assign_buckets(opts_.bucket_bytes);
}

std::size_t DataParallel::buckets_launched() const { return state_->next_launch; }

DataParallel::NoSync::NoSync(DataParallel& dp) : dp_(dp) { ++dp_.state_->no_sync_depth; }
DataParallel::NoSync::~NoSync() { --dp_.state_->no_sync_depth; }

void DataParallel::unshard() {
  if (sharded_) sharded_->unshard();
}

void DataParallel::add_step_hook(StepHook hook) { hooks_.push_back(std::move(hook)); }

void DataParallel::finish_step() {
  State& st = *state_;
  if (st.no_sync_depth > 0)
    throw std::invalid_argument(
        "[DataParallel] finish_step() inside no_sync(): leave the no_sync "
        "region for the step that reduces the accumulated gradients");
  NoGradGuard no_grad;
  // Which parameters have a gradient on this rank (used, or accumulated);
  // one reduced during backward may have handed its gradient to its owner.
  Tensor used = zeros({int64_t(st.slots.size())}, {.dtype = DType::u8});
  uint8_t* u = used.data<uint8_t>();
  for (std::size_t i = 0; i < st.slots.size(); ++i) {
    State::Slot& s = st.slots[i];
    const Tensor g = s.param.grad();
    u[i] = s.ready || g.defined();
    if (s.ready) continue;
    // Not reduced during backward: unused this step, or accumulated under
    // no_sync. Contribute what we have (zeros when nothing).
    State::Bucket& b = st.buckets[s.bucket];
    Tensor dst = st.flat_of(b).narrow(0, s.offset, s.param.numel());
    if (g.defined())
      copy_(dst, g.reshape({s.param.numel()}));
    else
      fill_(dst, 0.0);
    s.ready = true;
    --b.pending;
  }
  st.launch_ready();
  st.comm->drain();
  st.grads->all_reduce(used, ReduceOp::max);
  for (std::size_t i = 0; i < st.slots.size(); ++i) {
    State::Slot& s = st.slots[i];
    s.ready = false;
    if (st.owned_elsewhere(s.owner)) {
      s.param.set_grad(Tensor());  // its owner has the average
      continue;
    }
    if (!u[i]) continue;  // unused on every rank: keep no gradient
    Tensor avg =
        st.buckets[s.bucket].flat.narrow(0, s.offset, s.param.numel()).reshape(s.param.shape());
    Tensor g = s.param.grad();
    if (g.defined())
      copy_(g, avg);
    else
      s.param.set_grad(avg.clone());
  }
  for (auto& b : st.buckets) {
    b.pending = int(b.slots.size());
    if (st.owned_elsewhere(b.owner)) b.flat = Tensor();
  }
  st.next_launch = 0;
  if (opts_.broadcast_buffers && !st.buffers.empty()) {
    for (auto& [name, b] : st.buffers) st.grads->broadcast(b, 0);
    module_->reload_host_state();
  }
  for (auto& hook : hooks_) hook(group_);
}

}  // namespace quanta::dist
