// `quanta bench dist -n N`: collectives and DataParallel, on N ranks run as
// threads of this process over Gloo on loopback (one TcpStore, as under
// quanta launch).
//   all_reduce_4KB / _1MB / _64MB: ProcessGroup::all_reduce (f32, sum), with
//     its always-on mismatch check (docs/dist.md "The always-on check"),
//     against the backend's bare all_reduce on the same connections and
//     buffers (same reduction function), in the same run. The _debug rows
//     time the same call with QUANTA_DIST_DEBUG's fingerprint exchange
//     against the same floor. The _vs_ring rows time that bare all_reduce
//     against Gloo's ring allreduce: on two ranks up to 4 MiB the backend
//     exchanges the buffers in one round instead (GlooBackend::kPairwiseBytes);
//     elsewhere both are the ring.
//   broadcast_4KB / _1MB, all_gather_4KB / _1MB: the same for the byte
//     collectives (ProcessGroup's call with its check against the bare
//     backend call). The broadcast's root is rank 1, so the timing rank 0
//     waits for the data.
//   dp_step: forward + backward + finish_step of an MLP under DataParallel,
//     each rank on 1/N of the batch, against the same step on one process
//     with the whole batch (no DataParallel, this thread alone).
//   vq_train_step_dist: a VectorQuantize training step (forward, backward,
//     QuantizerSync::sync_state: EMA reconciled) with dim 256, 1024 codes
//     and 4096 tokens per rank, default options (no dead-code expiry),
//     against the same step on one process with the whole global batch
//     (N x 4096 tokens).
//   vq_reconcile: the sync_state() part of that step, against the whole
//     step: its ratio is the reconciliation's fraction of the step. A
//     barrier before sync_state() stands in for DataParallel's gradient
//     all-reduce (which runs before the step hooks and absorbs the ranks'
//     skew), so waiting for a slower rank counts in the step, not in the
//     reconciliation.
//   vq_reconcile_vs_comm: the same sync_state() time against the bare Gloo
//     all_reduce of the same bytes as its fused one (header, counts, EMA
//     sums), timed right after it in each step: how much of the
//     reconciliation is communication this machine cannot avoid.
//   vq_reconcile_dead_codes: vq_reconcile with threshold_ema_dead_code = 2
//     (as quanta train's default config): on this random data about a
//     quarter of the codes expire every step, so every reconciliation also
//     draws and sends replacement rows (a second all_reduce).
// Each rank thread computes on its share of the threads (OpenMP's thread
// count is per thread), as ranks under `quanta launch` do (it sets
// OMP_NUM_THREADS=1 on this 2-core class of machine); one-process floors use
// every thread.
// Small messages are timed in batches (per-call times are reported). Times
// are rank 0's; every rank runs the same loop, so they are in lockstep.
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

#include "bench.h"
#include "dist/backend/gloo_backend.h"
#include "dist/backend/reduce_kernels.h"
#include "dist/data_parallel.h"
#include "dist/process_group.h"
#include "quant/sync/quantizer_sync.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

using dist::Millis;

std::shared_ptr<Sequential> mlp(int64_t width, uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<Sequential>(std::make_shared<Linear>(width, 2 * width, gen),
                                      std::make_shared<ReLU>(),
                                      std::make_shared<Linear>(2 * width, width, gen));
}

struct VqSizes {
  int64_t dim, codes, tokens;
};
VqSizes vq_sizes(const BenchOptions& o) {
  return o.small ? VqSizes{32, 64, 256} : VqSizes{256, 1024, 4096};
}

struct VqStepMs {
  double step = 0, sync = 0, comm = 0;
};

// Median times of a VQ training step on `g` (each rank `tokens` rows) and of
// its sync_state() part.
VqStepMs time_vq_step(dist::ProcessGroup& g, int repeat, const VqSizes& s, int64_t tokens,
                      double dead_code_threshold) {
  using clock = std::chrono::steady_clock;
  Generator gen(5);
  quant::VectorQuantizeOptions vo;
  vo.dim = s.dim;
  vo.codebook_size = s.codes;
  vo.threshold_ema_dead_code = dead_code_threshold;
  auto vq = std::make_shared<quant::VectorQuantize>(vo, gen);
  quant::QuantizerSync sync(vq, g);
  Generator data(17 + uint64_t(g.rank()));
  Tensor x = randn({1, tokens, s.dim}, data);
  x.requires_grad_(true);
  // The bytes sync_state() must move, sent by bare Gloo right after it: its
  // one fused all_reduce of the header block (per rank: forwards and
  // candidate rows, three f32 pieces each), the counts, the token total and
  // the f32 EMA sums. (Replacement rows, when codes expire, take a second
  // all_reduce that varies by step and is left out of this floor.)
  auto* bare = g.size() > 1 ? dist::detail::gloo_backend_of(g) : nullptr;
  const auto sum_fn = dist::detail::reduce_fn(DType::f32, dist::ReduceOp::sum);
  Tensor fused = zeros({int64_t(g.size()) * 2 * 3 + s.codes + 1 + s.codes * s.dim});
  uint32_t tag = 0x52000000;
  std::vector<double> step, reconcile, comm;
  for (int i = 0; i <= repeat; ++i) {
    const auto t0 = clock::now();
    const quant::QuantizeOutput out = vq->forward(x);
    (mean(square(out.quantized)) + out.loss).backward();
    // Under DataParallel the gradient all-reduce runs before the step hooks
    // and absorbs the ranks' skew; this step has no parameter gradients, so
    // a barrier stands in for it and the skew is not billed to sync_state.
    g.barrier();
    const auto t1 = clock::now();
    sync.sync_state();
    const auto t2 = clock::now();
    x.zero_grad();
    double comm_ms = 0;
    if (bare) {
      g.barrier();
      const auto c0 = clock::now();
      bare->all_reduce(fused.raw_data(), static_cast<std::size_t>(fused.numel()), 4, sum_fn, tag++,
                       Millis(60000));
      comm_ms = std::chrono::duration<double, std::milli>(clock::now() - c0).count();
    }
    if (i == 0) continue;  // warm-up
    step.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
    reconcile.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    comm.push_back(comm_ms);
  }
  return {median_of(step), median_of(reconcile), median_of(comm)};
}

void rank_body(dist::ProcessGroup& g, dist::ProcessGroup& debug_g, const BenchOptions& o,
               std::vector<BenchRow>& rows) {
  struct Size {
    const char* name;
    int64_t bytes;
    int calls;
  };
  const Size sizes[] = {{"4KB", 4 << 10, 200}, {"1MB", 1 << 20, 10}, {"64MB", 64 << 20, 1}};
  auto* bare = dist::detail::gloo_backend_of(g);
  const auto sum_fn = dist::detail::reduce_fn(DType::f32, dist::ReduceOp::sum);
  uint32_t tag = 0x51000000;
  for (const Size& s : sizes) {
    const int64_t bytes = o.small ? std::min<int64_t>(s.bytes, 64 << 10) : s.bytes;
    Tensor t = full({bytes / 4}, 1.0);
    const auto n = static_cast<std::size_t>(t.numel());
    const auto ms4 = interleaved_ms(
        o.repeat, s.calls,
        {[&] { bare->all_reduce(t.raw_data(), n, 4, sum_fn, tag++, Millis(60000)); },
         [&] { g.all_reduce(t); }, [&] { debug_g.all_reduce(t); },
         [&] { bare->ring_all_reduce(t.raw_data(), n, 4, sum_fn, tag++, Millis(60000)); }});
    const double floor_ms = ms4[0], ms = ms4[1], debug_ms = ms4[2], ring_ms = ms4[3];
    if (g.rank() == 0) {
      rows.push_back({std::string("all_reduce_") + s.name, ms, floor_ms});
      rows.push_back({std::string("all_reduce_") + s.name + "_debug", debug_ms, floor_ms});
      rows.push_back({std::string("all_reduce_") + s.name + "_vs_ring", floor_ms, ring_ms});
    }
  }
  // The byte collectives' check: the payload carries the fingerprint.
  for (const Size& s : sizes) {
    if (s.bytes > (1 << 20)) continue;
    const int64_t bytes = o.small ? std::min<int64_t>(s.bytes, 64 << 10) : s.bytes;
    Tensor t = full({bytes / 4}, 1.0);
    Tensor gathered = empty({int64_t(g.size()) * (bytes / 4)});
    const int root = g.size() - 1;
    const auto ms4 = interleaved_ms(
        o.repeat, s.calls,
        {[&] { bare->broadcast(t.raw_data(), t.nbytes(), root, tag++, Millis(60000)); },
         [&] { g.broadcast(t, root); },
         [&] {
           bare->all_gather(t.raw_data(), gathered.raw_data(), t.nbytes(), tag++, Millis(60000));
         },
         [&] { (void)g.all_gather(t); }});
    if (g.rank() == 0) {
      rows.push_back({std::string("broadcast_") + s.name, ms4[1], ms4[0]});
      rows.push_back({std::string("all_gather_") + s.name, ms4[3], ms4[2]});
    }
  }
  // DataParallel step: each rank takes its share of the batch.
  const int64_t width = o.small ? 32 : 512, batch = o.small ? 8 : 256;
  auto model = mlp(width, 7);
  dist::DataParallel dp(model, g);
  Generator gen(11 + g.rank());
  const Tensor x = randn({batch / g.size(), width}, gen);
  const double dp_ms = median_ms(o.repeat, [&] {
    sum(dp(x)).backward();
    dp.finish_step();
    model->zero_grad();
  });
  if (g.rank() == 0) rows.push_back({"dp_step", dp_ms, 0});

  const VqSizes vs = vq_sizes(o);
  const VqStepMs vq = time_vq_step(g, o.repeat, vs, vs.tokens, 0);
  const VqStepMs dead = time_vq_step(g, o.repeat, vs, vs.tokens, 2);
  if (g.rank() == 0) {
    rows.push_back({"vq_train_step_dist", vq.step, 0});
    rows.push_back({"vq_reconcile", vq.sync, vq.step});
    rows.push_back({"vq_reconcile_vs_comm", vq.sync, vq.comm});
    rows.push_back({"vq_reconcile_dead_codes", dead.sync, dead.step});
  }
}

}  // namespace

void run_thread_ranks(int n, const std::function<void(std::shared_ptr<dist::Store>, int)>& body) {
  dist::TcpStoreServer server(0);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  const int per_rank = std::max(1, num_threads() / n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      // This thread's parallel regions (OpenMP keeps the count per thread; Eigen
      // follows it).
      set_num_threads(per_rank);
      try {
        body(std::make_shared<dist::TcpStore>("127.0.0.1", server.port(), false, Millis(30000)), r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    if (!errors[r].empty())
      throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
}

std::vector<BenchRow> bench_dist(const BenchOptions& o) {
  const int n = o.ranks;
  std::vector<BenchRow> rows;
  try {
    run_thread_ranks(n, [&](std::shared_ptr<dist::Store> store, int r) {
      dist::GroupOptions go;
      go.timeout = Millis(60000);
      go.debug = 0;
      dist::ProcessGroup g(store, r, n, go);
      go.debug = 1;
      go.name = "debug";
      dist::ProcessGroup debug_g(store, r, n, go);
      rank_body(g, debug_g, o, rows);
    });
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("bench dist: ") + e.what());
  }
  // The one-process floor of the DataParallel step, alone on the machine.
  const int64_t width = o.small ? 32 : 512, batch = o.small ? 8 : 256;
  auto model = mlp(width, 7);
  Generator gen(11);
  const Tensor x = randn({batch, width}, gen);
  const double one_ms = median_ms(o.repeat, [&] {
    sum(model->forward(x)).backward();
    model->zero_grad();
  });
  auto single = dist::ProcessGroup::single();
  const VqSizes vs = vq_sizes(o);
  const double vq_one_ms = time_vq_step(*single, o.repeat, vs, vs.tokens * n, 0).step;
  for (auto& r : rows) {
    if (r.name == "dp_step") r.floor_ms = one_ms;
    if (r.name == "vq_train_step_dist") r.floor_ms = vq_one_ms;
  }
  return rows;
}

}  // namespace quanta::cli
