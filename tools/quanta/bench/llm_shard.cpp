// `quanta bench llm -n N`: what sharding the NF4 base costs and saves. One
// QLoRA training step (layers recomputed in the backward, the setting
// sharding is for) of the llm suite's Llama on N ranks, the base sharded
// (DataParallelOptions::shard_units) against replicated, the same global
// batch (B 4 x T 512) split across the ranks. Each rank is a thread on its
// own sim device, so that its memory is counted exactly (sim's allocator
// statistics; a GPU's would be the same bytes), and computes with its share
// of the threads. Rows (rank 0's; every rank runs the same loop):
//   qlora100m_shardN_step: ms of the sharded step; floor: the replicated
//     step on the same ranks, timed in turns. Goal: ratio <= 1.25.
//   qlora100m_shardN_base: MB a rank holds between steps (model, adapters'
//     gradients and AdamW state, after a first step); floor: replicated.
//     The NF4 base is most of it; the sharded side also splits the AdamW
//     state and the adapters' gradients (dist::OptimizerShards, reduced
//     into their owners), as quanta finetune --shard does.
//   qlora100m_shardN_peak: peak MB per rank during a step; floor:
//     replicated.
//   qlora100m_shardN_gathered: MB gathered per step; floor: the NF4 base's
//     MB, so the ratio is 2 (a gather before the forward and another before
//     the recomputation).
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "dist/data_parallel.h"
#include "dist/optimizer_shards.h"
#include "llm/model/causal_lm.h"
#include "llm/qlora/qlora_model.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

double mb(double bytes) { return bytes / (1024.0 * 1024.0); }

// One replica of the QLoRA model on `dev` with its optimizer, and the
// device memory it holds between steps.
struct Replica {
  std::shared_ptr<llm::CausalLM> model;
  std::unique_ptr<dist::DataParallel> dp;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<dist::OptimizerShards> opt_shards;  // sharded replicas
  int64_t resident = 0;
};

void train_step(Replica& r, const Tensor& ids) {
  r.opt->zero_grad();
  r.model->lm_loss(r.model->hidden_states(ids), ids).backward();
  r.dp->finish_step();
  r.opt->step();
  if (r.opt_shards) r.opt_shards->broadcast_updates();
}

// Built, then one step, so that what it holds between steps (AdamW's state
// made at the first) is counted.
Replica make_replica(const llm::DecoderConfig& c, Device dev, dist::ProcessGroup& g, bool shard,
                     const Tensor& ids) {
  const int64_t before = device_stats(dev).allocated_bytes;
  Replica r;
  Generator gen(321);  // the same weights on every rank
  r.model = llm::CausalLM::random(c, gen, dev);
  llm::QLoRAOptions q;
  q.lora.r = 16;
  q.lora.lora_alpha = 32;
  q.lora.lora_dropout = 0.05;
  q.quantization.compute_dtype = DType::f32;
  llm::apply_qlora(*r.model, q);
  r.model->set_recompute_layers(true);
  dist::DataParallelOptions o{.broadcast_buffers = false};
  if (shard) o.shard_units = r.model->layer_names();
  r.dp = std::make_unique<dist::DataParallel>(r.model, g, o);
  std::vector<Tensor> adapters;
  for (const Tensor& p : r.model->parameters())
    if (p.requires_grad()) adapters.push_back(p);
  r.opt = std::make_unique<AdamW>(adapters, AdamWOptions{.lr = 2e-4, .weight_decay = 0.0});
  if (shard) {
    r.opt_shards = std::make_unique<dist::OptimizerShards>(g, adapters);
    r.opt_shards->reduce_gradients_to_owners(*r.dp);
  }
  train_step(r, ids);
  synchronize(dev);
  r.resident = device_stats(dev).allocated_bytes - before;
  return r;
}

// Peak device bytes of one step of `r`, counting `r`'s resident memory but
// not the other replica's (which sits unchanged on the same device).
int64_t step_peak(Replica& r, const Tensor& ids, Device dev) {
  synchronize(dev);
  const int64_t resting = device_stats(dev).allocated_bytes;
  reset_device_stats(dev);
  train_step(r, ids);
  synchronize(dev);
  return device_stats(dev).peak_allocated_bytes - resting + r.resident;
}

}  // namespace

std::vector<std::string> llm_shard_row_names(const BenchOptions& o) {
  const std::string tag = "qlora" + llm_size_tag(o) + "_shard" + std::to_string(o.ranks);
  return {tag + "_step", tag + "_base", tag + "_peak", tag + "_gathered"};
}

std::vector<BenchRow> bench_llm_shard(const BenchOptions& o, const llm::DecoderConfig& c) {
  const int n = o.ranks;
  // The ~500M model's step at B 4 x T 128, so that its rows take minutes.
  const int64_t batch = o.small ? 2 : 4, tokens = o.small ? 32 : o.large ? 128 : 512;
  const std::vector<std::string> names = llm_shard_row_names(o);
  if (n < 2) return {unavailable_row(names[0], "sharding needs -n 2 or more ranks")};
  std::vector<BenchRow> rows;
  run_thread_ranks(n, [&](std::shared_ptr<dist::Store> store, int rank) {
    dist::GroupOptions go;
    go.timeout = dist::Millis(600000);  // a step of the 100M model on one thread is minutes
    dist::ProcessGroup g(store, rank, n, go);
    const Device dev = Device::sim(rank);
    Generator data_gen(7);
    const Tensor all = randint(0, c.vocab_size, {batch, tokens}, data_gen);
    const int64_t lo = batch * rank / n, hi = batch * (rank + 1) / n;
    const Tensor ids = all.narrow(0, lo, hi - lo).contiguous().to(dev);
    Replica replicated = make_replica(c, dev, g, false, ids);
    Replica sharded = make_replica(c, dev, g, true, ids);
    const std::vector<double> ms = interleaved_ms(
        o.repeat, 1, {[&] { train_step(sharded, ids); }, [&] { train_step(replicated, ids); }},
        [&] { synchronize(dev); });
    const int64_t peak_sharded = step_peak(sharded, ids, dev);
    const int64_t peak_replicated = step_peak(replicated, ids, dev);
    const dist::ShardedUnits& units = *sharded.dp->sharded();
    const uint64_t gathered_before = units.gathered_bytes();
    train_step(sharded, ids);
    const double gathered = double(units.gathered_bytes() - gathered_before);
    if (rank != 0) return;
    rows.push_back({names[0], ms[0], ms[1]});
    BenchRow base{names[1], mb(double(sharded.resident)), mb(double(replicated.resident))};
    BenchRow peak{names[2], mb(double(peak_sharded)), mb(double(peak_replicated))};
    BenchRow moved{names[3], mb(gathered), mb(double(units.full_bytes()))};
    for (BenchRow* r : {&base, &peak, &moved}) {
      r->unit = "MB";
      rows.push_back(*r);
    }
  });
  return rows;
}

}  // namespace quanta::cli
