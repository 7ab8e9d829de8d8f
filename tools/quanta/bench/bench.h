#pragma once
// What every `quanta bench` suite shares: a row is one timing next to its
// floor (the best a kernel could do: a bare library call or a memcpy of the
// bytes the op must move), and ratio = ms / floor_ms.
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "dist/store/store.h"
#include "engine/device.h"
#include "llm/model/config.h"

namespace quanta {
class Generator;
}

namespace quanta::cli {

/** One benchmark result: median milliseconds of the op and of its floor. */
struct BenchRow {
  std::string name;
  double ms = 0;
  double floor_ms = 0;
  /** Why the row could not be measured (the op's error); "" when it was. */
  std::string unavailable = {};
  /** On a device (`bench train --device cuda|sim`): how often one step
   * waits for the device (device-to-host copies) and how many copies it
   * makes in all; negative when not measured (the CPU). */
  double host_syncs_per_step = -1;
  double copies_per_step = -1;
  /** What ms and floor_ms hold when the row is not a time ("MB": a memory
   * row, its value against its floor's); empty for milliseconds. */
  std::string unit{};
  /** How many times slower than its floor the op is (1 = at the floor). */
  double ratio() const { return ms / floor_ms; }
};

/** What every suite is run with. */
struct BenchOptions {
  int repeat = 5;      // timed runs per measurement (the median is reported)
  bool small = false;  // tiny sizes: a smoke test, not a measurement
  bool large = false;  // llm suite: the ~500M config, its sharding rows only
  int ranks = 2;       // ranks for suites that run collectives (dist)
  Device device;       // where the suites run (cpu or cuda:N; train also sim:N)
  std::string only{};  // llm suite: only the rows whose name this regular expression finds
};

/** The median of `samples` (the mean of the middle two for an even count). */
double median_of(std::vector<double> samples);

/** Median wall time in milliseconds of `repeat` calls of `fn`, after one
 * untimed warm-up call. */
double median_ms(int repeat, const std::function<void()>& fn);

/** Median per-call milliseconds of several functions timed in turns (one
 * batch of `calls` calls of each per round, `repeat` rounds after an untimed
 * warm-up round), so load from other processes hits all of them alike: the
 * way to time an op and its floor when their ratio is the figure. `sync`,
 * when given, runs at the end of each batch inside its time (for a GPU:
 * wait until the queued work is done). */
std::vector<double> interleaved_ms(int repeat, int calls,
                                   const std::vector<std::function<void()>>& fns,
                                   const std::function<void()>& sync = {});

/** memcpy on every CPU thread, in 64 KiB blocks: the floor of an op that
 * reads and writes `bytes` once. */
void parallel_memcpy(uint8_t* dst, const uint8_t* src, int64_t bytes);

/** A row that could not be measured, with the error's text. */
BenchRow unavailable_row(const std::string& name, const std::string& why);

/** Prints rows as an aligned table "name ms floor_ms ratio", or as a JSON
 * list of objects with keys name, ms, floor_ms, ratio; rows measured on a
 * device add host_syncs_per_step and copies_per_step (columns "syncs" and
 * "copies"). */
void print_rows(std::ostream& out, const std::vector<BenchRow>& rows, bool json);

/** A bench suite: runs and returns its rows. */
using BenchSuite = std::vector<BenchRow> (*)(const BenchOptions&);

/** Engine kernels: matmul against a bare Eigen GEMM, elementwise ops and a
 * reduction against memcpy (see engine.cpp for the conventions); on
 * a CUDA device, bench_engine_cuda's rows. */
std::vector<BenchRow> bench_engine(const BenchOptions& opts);
/** The engine suite on opts.device, a GPU: elementwise ops and reductions
 * against a device-to-device copy of the same bytes, GEMM (f32, bf16, f16)
 * against cuBLAS's rate on its peak shape, the convolutions
 * (engine_cuda.cpp). */
std::vector<BenchRow> bench_engine_cuda(const BenchOptions& opts);

/** The engine suite's convolution rows: each layer of the main job's VQ-VAE
 * forward and backward on opts.device against a large GEMM's time for the
 * same FLOPs (conv.cpp). `sync` ends each timed batch (for a GPU). */
std::vector<BenchRow> bench_conv(const BenchOptions& opts, Generator& gen,
                                 const std::function<void()>& sync = {});
/** FLOPs of the main job's convolutions forward and backward at `batch`
 * (the input gradient of the first layer is not taken). */
double main_job_conv_flops(int64_t batch);

/** One training step of `quanta train`'s models (VQ-VAE with vq, none and
 * fsq; the classifier) against a large GEMM's time for their FLOPs; on a
 * CUDA device, against the same step on the CPU (train.cpp). */
std::vector<BenchRow> bench_train(const BenchOptions& opts);

/** Quantizer train steps: the VQ family's rows then the scalar family's; on
 * a CUDA device, bench_quant_cuda's rows. */
std::vector<BenchRow> bench_quant(const BenchOptions& opts);
/** The quant suite on opts.device, a GPU: the VQ nearest-code search against
 * the cuBLAS GEMM of its shape (quant_cuda.cpp). */
std::vector<BenchRow> bench_quant_cuda(const BenchOptions& opts);
/** The VQ family's rows of `bench quant` (quant_vq.cpp). */
std::vector<BenchRow> bench_quant_vq(const BenchOptions& opts);
/** The FSQ / LFQ rows of `bench quant` (quant_scalar.cpp). */
std::vector<BenchRow> bench_quant_scalar(const BenchOptions& opts);
/** NF4 format and nf4_linear (bench_nf4.cpp); on a CUDA device,
 * bench_nf4_cuda's rows. */
std::vector<BenchRow> bench_nf4(const BenchOptions& opts);
/** The nf4 suite on opts.device, a GPU: dequantize against a device copy,
 * the small-batch GEMV against cuBLAS's bf16 GEMV, a large-batch nf4_linear
 * against the f32 GEMM (bench_nf4_cuda.cpp). */
std::vector<BenchRow> bench_nf4_cuda(const BenchOptions& opts);
/** Attention and a ~110M Llama against PyTorch in a peer process, timed in
 * turns; floor_ms is PyTorch's (llm.cpp). */
std::vector<BenchRow> bench_llm(const BenchOptions& opts);
/** The llm suite's sharding rows on opts.ranks ranks: a QLoRA step with
 * its NF4 base sharded against the same step replicated, in time, memory
 * per rank and bytes gathered (llm_shard.cpp). */
std::vector<BenchRow> bench_llm_shard(const BenchOptions& opts, const llm::DecoderConfig& config);
/** The llm suite's Llama for `opts`' size, and its tag in row names
 * ("small", "100m", "500m"). */
llm::DecoderConfig bench_llm_config(const BenchOptions& opts);
std::string llm_size_tag(const BenchOptions& opts);
/** One row of the llm suite: quanta's step and the peer's setup line for
 * the same work ("setup NAME KEY=VALUE...", tools/peer/llm_bench_peer.py). */
struct LlmWorkload {
  std::string name;
  std::string peer_setup;
  std::function<void()> run;
};
/** The suite's QLoRA training step, as its row's name ends: plain; _mixed,
 * under MixedPrecision (the peer autocasts); _graph (a device that
 * records), its forward and backward replayed as a captured graph
 * (train/captured_step.h), against the peer's plain step; _recompute, each
 * decoder layer recomputed in the backward (finetune --recompute), against
 * the peer's gradient checkpointing; _dora, DoRA adapters (finetune
 * --use-dora), against PEFT's use_dora. */
enum class QLoRAVariant { plain, mixed, graph, recompute, dora };
/** That step of `config` (llm.cpp). */
LlmWorkload qlora_workload(const BenchOptions& opts, const llm::DecoderConfig& config,
                           Generator& gen, QLoRAVariant variant = QLoRAVariant::plain);
/** `config` as the peer's KEY=VALUE words. */
std::string llm_peer_config(const llm::DecoderConfig& config);
/** Peak resident memory in MB of a fresh quanta process that builds
 * qlora_workload and runs its step twice, so that nothing else this process
 * holds counts (llm_peak_rss.cpp). Throws naming what failed. */
double qlora_peak_rss_mb(const BenchOptions& opts);
/** When this process is that child (QUANTA_BENCH_LLM_PEAK_RSS set): does
 * its work, prints "peak_rss_mb X" and returns true. */
bool run_as_peak_rss_child(const BenchOptions& opts);
/** The names of bench_llm_shard's rows. */
std::vector<std::string> llm_shard_row_names(const BenchOptions& opts);
/** Collectives and DataParallel (dist.cpp). */
std::vector<BenchRow> bench_dist(const BenchOptions& opts);

/** Runs body(store, rank) on n threads as the ranks of one job (a TcpStore
 * on loopback between them), each computing with its share of the threads
 * (OpenMP's count is per thread), as ranks under quanta launch do. Throws
 * naming the first rank that failed. */
void run_thread_ranks(int n, const std::function<void(std::shared_ptr<dist::Store>, int)>& body);

}  // namespace quanta::cli
