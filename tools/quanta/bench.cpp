// `quanta bench SUITE`: the suite registry and the command. The suites and
// their timing and report are in bench/.
#include "bench/bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/parallel.h"
#include "engine/cuda/module.h"
#include "fast_conv.h"
#include "flag_checks.h"
#include "wait_policy.h"

namespace quanta::cli {
namespace {

struct SuiteInfo {
  BenchSuite run;
  const char* about;
  bool cuda = false;  // runs on --device cuda
};

// Later suites add one line here.
const std::map<std::string, SuiteInfo>& suites() {
  static const std::map<std::string, SuiteInfo> all = {
      {"engine",
       {bench_engine, "engine kernels: matmul, add, exp, sum, the main job's convolutions", true}},
      {"quant",
       {bench_quant, "quantizer train steps (VQ, RVQ, FSQ, LFQ) against their GEMMs", true}},
      {"nf4", {bench_nf4, "NF4 quantize, dequantize and nf4_linear against memcpy and f32", true}},
      {"train",
       {bench_train,
        "one training step of quanta train's models and of quanta finetune's QLoRA against a "
        "GEMM of their FLOPs",
        true}},
      {"dist", {bench_dist, "collectives and DataParallel against bare Gloo and one process"}},
      {"llm",
       {bench_llm,
        "causal attention and a ~110M Llama, forward and forward + backward, and a QLoRA step, "
        "against PyTorch (floor = PyTorch's time; ../shared/peer/setup.sh)",
        true}},
  };
  return all;
}

std::string suite_names(bool cuda_only = false) {
  std::string s;
  for (const auto& [name, info] : suites())
    if (!cuda_only || info.cuda) s += (s.empty() ? "" : ", ") + name;
  return s;
}

struct BenchCommand {
  std::string suite;
  bool json = false;
  std::string size = "full";
  std::string device = "cpu";
  int threads = 0;
  bool fast_conv = false;
  BenchOptions opts;
};

// Why this process cannot run on `d` ("" when it can): a build without CUDA
// or a machine without a GPU is not an error, the suite is skipped.
std::string cuda_skip_reason(Device d) {
  if (!cuda_built()) return "this quanta was built without CUDA";
  const int visible = cuda_device_count();
  if (visible == 0) {
    const std::string& why = cuda::unavailable_reason();
    return why.empty() ? "no CUDA device is visible" : why;
  }
  if (d.index >= visible)
    throw UsageError("--device " + d.str() + ": " + std::to_string(visible) +
                     " CUDA devices are visible");
  return "";
}

void run_bench(BenchCommand& c) {
  if (c.threads > 0) set_num_threads(c.threads);
  apply_fast_conv(c.fast_conv);
  c.opts.small = c.size == "small";
  c.opts.large = c.size == "large";
  if (c.opts.large && c.suite != "llm")
    throw UsageError("--size large is for bench llm (its ~500M config), not " + c.suite);
  c.opts.device = Device::parse(c.device);
  if (c.opts.device.is_sim() && c.suite != "train" && c.suite != "llm")
    throw UsageError("--device " + c.device + ": the " + c.suite +
                     " suite times the CPU or a GPU, and sim runs the CPU's kernels (bench "
                     "train takes sim: it counts each step's host syncs; bench llm runs its "
                     "GPU path there)");
  const SuiteInfo& suite = suites().at(c.suite);
  if (c.opts.device.is_cuda()) {
    if (!suite.cuda)
      throw UsageError("--device " + c.device + ": the " + c.suite +
                       " suite runs on the CPU only (" + suite_names(true) + " run on CUDA)");
    if (const std::string why = cuda_skip_reason(c.opts.device); !why.empty()) {
      // One line and success: scripts (tools/gpu-check.sh, CI) run the
      // command everywhere and read the line where there is no GPU.
      (c.json ? std::cerr : std::cout)
          << "quanta bench " << c.suite << " --device " << c.device << ": skipped: " << why << "\n";
      if (c.json) std::cout << "[]\n";
      return;
    }
  }
  const std::vector<BenchRow> rows = suite.run(c.opts);
  if (!c.json)
    std::cout << "# quanta bench " << c.suite << ": " << num_threads()
              << " threads (OpenMP waits: " << wait_policy_name() << "), size " << c.size
              << ", median of " << c.opts.repeat
              << (!c.opts.device.is_cpu() ? ", on " + c.opts.device.str() : std::string())
              << "; CPU bf16 products " << cpu::bf16_gemm_reason() << "\n";
  print_rows(std::cout, rows, c.json);
}

}  // namespace

void add_bench(CLI::App& app) {
  auto c = std::make_shared<BenchCommand>();
  std::string about;
  for (const auto& [name, info] : suites()) about += "\n  " + name + ": " + info.about;
  CLI::App* sub = app.add_subcommand(
      "bench", "Time a suite of kernels against their floors (suites: " + suite_names() + ")");
  sub->footer(
      "Examples:\n"
      "  quanta bench engine\n"
      "  quanta bench quant --size small --json\n"
      "  quanta bench dist -n 4 --repeat 10\n"
      "Each row: the median time of the op (ms), of its floor (floor_ms), and ratio = "
      "ms / floor_ms.\nSuites:" +
      about +
      "\n\nengine conventions: matmul_MxKxN multiplies A [M, K] by B [K, N] in f32 "
      "(matmul_1024: M = K = N = 1024) against a bare Eigen GEMM, which runs on one thread "
      "(quanta builds Eigen unthreaded; below 1 where quanta's GEMM threads or runs on "
      "OpenBLAS); the 3136x16x4, 3136x4x16 and 1568x512x32 rows are the main job's skinny "
      "products (FSQ's projections, a chunk of a convolution as a GEMM). "
      "matmul_bf16_MxKxN (builds with oneDNN): oneDNN's bf16 products against the f32 "
      "product of the same values, timed in turns (below 1 where bf16 products pay on this "
      "CPU; the header's last words say whether quanta takes them). add, "
      "exp and sum run on 16M-element f32 tensors against a multithreaded memcpy with the "
      "same memory traffic: a memcpy of n bytes reads n and writes n; add reads 2 buffers "
      "and writes 1, so its floor copies 1.5 buffers; exp reads 1 and writes 1 (1 buffer); "
      "sum reads 1 (half a buffer). Op times include allocating their outputs. conv_* rows: "
      "each convolution of the main job's VQ-VAE at batch 64, forward and backward, channels "
      "last as the model runs them (channels first on a GPU), against the time a 1024^3 "
      "matmul takes for the same FLOPs (timed in turns with it); with oneDNN in the build, "
      "each also gets a *_onednn row: the same step against itself with oneDNN's convolutions "
      "off (quanta's own kernels), timed in the same turns (below 1: oneDNN's are faster)."
      "\n\ntrain conventions: one optimizer step at batch 64 on random images against the time a "
      "1024^3 matmul takes for the step's FLOPs (convolutions or Linear layers forward and "
      "backward, plus vq's distance GEMM)."
      "\n\n--device cuda: engine's elementwise ops and reductions run against a "
      "device-to-device copy of the same bytes, matmul and conv rows against the time an "
      "8192^3 matmul of the same dtype (cuBLAS's peak shape) takes for their FLOPs; train's "
      "steps run against the same step on the CPU; quant's nearest-code searches against the "
      "f32 GEMM of their shape; nf4's dequantize against a device copy of the bytes it moves, "
      "its batch-1 GEMV against cuBLAS's bf16 GEMV and its batch-512 nf4_linear against the "
      "f32 GEMM of the same shape; llm's rows (attention, the Llama, the QLoRA step in bf16 "
      "compute) against the same PyTorch workloads on the same GPU (the peer's python must "
      "import transformers, peft and bitsandbytes; --device sim runs quanta's side alone). A "
      "row whose op fails on the GPU prints 'unavailable' with the error.");
  sub->add_option("suite", c->suite, "the suite to run: " + suite_names())
      ->required()
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            if (suites().count(s)) return {};
            return "unknown bench suite '" + s + "' (suites: " + suite_names() + ")";
          },
          "SUITE"));
  sub->add_flag("--json", c->json,
                "print a JSON list of {name, ms, floor_ms, ratio} instead of a table");
  sub->add_option("-n,--ranks", c->opts.ranks,
                  "ranks for the dist suite and the llm suite's sharding rows")
      ->capture_default_str()
      ->transform(integer_in(2, 64));
  sub->add_option("--only", c->opts.only,
                  "llm suite: run only the rows whose name this regular expression finds "
                  "(qlora: every QLoRA row; qlora500m_B4_T512$: that row alone); each still "
                  "beside its peer");
  sub->add_option("--repeat", c->opts.repeat, "timed runs per measurement")
      ->capture_default_str()
      ->transform(integer_in(1, 1000));
  sub->add_option("--size", c->size,
                  "full (the sizes in the row names) or small (tiny sizes for a smoke test; "
                  "row names stay the same); bench llm also takes large (a ~500M Llama: its "
                  "QLoRA step, peak memory and the sharding rows of -n N)")
      ->capture_default_str()
      ->check(CLI::IsMember({"full", "small", "large"}));
  sub->add_option("--threads", c->threads, "CPU threads (default: OpenMP's default)")
      ->transform(thread_count());
  add_fast_conv_flag(*sub, c->fast_conv);
  sub->add_option("--device", c->device,
                  "cpu, cuda or cuda:N: where the suites but dist run (without a GPU "
                  "a cuda run prints one line saying why and exits 0)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            try {
              Device::parse(s);
              return {};
            } catch (const std::invalid_argument&) {
              return "--device must be cpu, cuda or cuda:N, got '" + s + "'";
            }
          },
          "DEVICE"));
  sub->callback([c] { run_bench(*c); });
}

}  // namespace quanta::cli
