#pragma once
// DataParallel: one model replica per rank, gradients averaged across ranks.
//
//   dist::DataParallel dp(model, *group);      // checks + broadcast from rank 0
//   for (...) {
//     Tensor loss = loss_fn(dp(x_local), y_local);
//     loss.backward();                          // buckets all-reduce as grads arrive
//     dp.finish_step();                         // wait, write averaged .grad, step hooks
//     opt.step();
//     opt.zero_grad();
//   }
//
// Construction checks that every rank holds the same parameter and buffer
// names, shapes and dtypes (an error naming the first difference otherwise)
// and broadcasts them from rank 0 as bytes (any dtype, nf4 included).
// During backward each parameter's post-accumulate hook copies its gradient
// into a bucket (reverse registration order, at most bucket_bytes, one dtype
// per bucket); a full bucket is all-reduced (avg) on a communication thread
// while backward goes on, or with reduce_gradients_to_owners reduced (avg)
// into the one rank that keeps those gradients (ZeRO-2). Buckets launch
// strictly in order, so every rank issues the same sequence whatever its graph.
//
// finish_step() is the one fixed point per optimizer step: it launches the
// buckets still waiting (parameters unused on this rank contribute zeros,
// so unused parameters never hang), waits, writes the averaged gradients
// (a parameter unused on every rank keeps an undefined .grad), broadcasts
// buffers from rank 0 when broadcast_buffers is on (then reload_host_state()),
// then runs the step hooks in the order they were added. Step hooks are where other replicated
// state (quantizer statistics, codebooks) is reconciled with a fixed sequence of collectives
// (docs/design.md rule 1). forward() itself issues no collective, so an extra, eval or no-grad
// forward on one rank cannot deadlock anything.
//
// With shard_units, the buffers of those modules (a QLoRA model's NF4 bases,
// by decoder layer) are sharded across ranks instead of replicated: each rank
// keeps 1/N of their bytes and gathers a unit just before its forward
// (dist/sharded_units.h). Those forwards are then collectives: every rank
// must run the same ones (evaluations too).
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "dist/sharded_units.h"
#include "engine/nn/module.h"

namespace quanta::dist {

struct DataParallelOptions {
  /** Largest bucket in bytes (PyTorch's bucket_cap_mb = 25). */
  std::size_t bucket_bytes = std::size_t(25) << 20;
  /** Broadcast buffers from rank 0 in every finish_step(). */
  bool broadcast_buffers = true;
  /** Parameter and buffer names left alone (not checked, broadcast or reduced). */
  std::vector<std::string> ignore{};
  /** Modules (dotted names, in forward order) whose buffers are sharded
   * across ranks and gathered just in time; empty: nothing is sharded.
   * Their bytes are checked equal on every rank, not broadcast. */
  std::vector<std::string> shard_units{};
  /** How they are sharded. */
  ShardOptions shard{};
  /** Units a loader sharded already, one at a time as it made them
   * (ShardedUnits' one-at-a-time form, on the same group), taken as they
   * are instead of sharding again: shard_units must be empty or name the
   * same units. */
  std::shared_ptr<ShardedUnits> sharded_units{};
};

class DataParallel {
 public:
  /** Wraps `module`; collective (every rank constructs it). `group` must
   * outlive this object. */
  DataParallel(std::shared_ptr<Module> module, ProcessGroup& group, DataParallelOptions opts = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /** The wrapped module's forward; no communication. */
  Tensor forward(const Tensor& x) { return module_->forward(x); }
  /** forward(x). */
  Tensor operator()(const Tensor& x) { return forward(x); }
  /** The wrapped module. */
  Module& module() { return *module_; }

  /** While alive, backward accumulates gradients locally (no communication);
   * the first step after it reduces the accumulated sum. */
  class NoSync {
   public:
    explicit NoSync(DataParallel& dp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DataParallel& dp_;
  };
  /** Starts a no-sync region (keep the returned guard alive). */
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  /** A callback run at the end of every finish_step(), on every rank, in the
   * order added; it may issue collectives on the group it is given. */
  using StepHook = std::function<void(ProcessGroup& group)>;
  /** Appends a step hook. */
  void add_step_hook(StepHook hook);
  /** Completes the step's gradient reduction, syncs buffers, runs step hooks.
   * Call once after the step's last backward, before the optimizer step. */
  void finish_step();

  /** Sends each parameter's averaged gradient to one owner rank only, a
   * reduce into it instead of an all-reduce (ZeRO stage 2, with
   * dist::OptimizerShards' owners): `owner(p)` is the rank that keeps
   * parameter p's gradient, or -1 for one every rank keeps. Buckets are
   * rebuilt to hold one owner's parameters each. From then on a rank's
   * gradients of parameters owned elsewhere are dropped as soon as they are
   * in a bucket, and after finish_step() those parameters have no .grad;
   * buckets of other owners hold no memory between steps. Call on every
   * rank with the same owners, between steps; no communication. */
  void reduce_gradients_to_owners(const std::function<int(const Tensor& param)>& owner);

  /** How many gradient buckets there are. */
  std::size_t num_buckets() const;
  /** Where bucket i lives: its parameters' device. */
  Device bucket_device(std::size_t i) const;
  /** The rank bucket i is reduced into, -1 for all of them. */
  int bucket_owner(std::size_t i) const;
  /** How many of this step's buckets have been handed to the communication
   * thread so far (read during backward, e.g. from a gradient hook, it shows
   * the overlap); finish_step() launches the rest and resets it to 0. */
  std::size_t buckets_launched() const;

  /** The sharded units (null without shard_units): their sizes and counters. */
  const ShardedUnits* sharded() const { return sharded_.get(); }
  /** Gathers the sharded units back for good: the module is whole again on
   * every rank (to merge or save it). Collective; no-op without sharding. */
  void unshard();

 private:
  struct State;
  std::shared_ptr<Module> module_;
  ProcessGroup& group_;
  DataParallelOptions opts_;
  std::shared_ptr<State> state_;
  std::shared_ptr<ShardedUnits> sharded_;
  std::vector<StepHook> hooks_;
};

}  // namespace quanta::dist
