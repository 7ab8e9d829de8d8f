// `quanta bench llm`: the language-model workloads against PyTorch on the
// same machine, timed in turns (interleaved_ms) with a long-lived PyTorch
// process (tools/peer/llm_bench_peer.py) that quanta drives over a pipe:
//   attention_T{512,2048}[_fb]: causal scaled dot-product attention, B 4,
//     12 heads of 64, forward (and forward + backward), against PyTorch's
//     F.scaled_dot_product_attention on [B, H, T, D] tensors.
//   attention_T{512,2048}_fb_reference (on cuda): the same with CUDA's
//     warp-per-row reference kernels instead of its whole-matrix products.
//   llama100m_B4_T512[_fb], llama100m_B1_T2048[_fb]: a ~110M-parameter
//     Llama (768 hidden, 12 layers, 12 heads, 2048 MLP, 32000 vocab, tied;
//     random weights, f32) forward (and forward + backward of the causal-LM
//     loss), against transformers' LlamaForCausalLM with attn_implementation
//     "sdpa".
//   llama100m_*_fb_mixed (where the CPU has bf16 products): the same
//     forward + backward in bf16 mixed precision, quanta's MixedPrecision
//     (engine/precision.h) against torch.autocast("cpu", bfloat16).
//   llama100m_B4_T512_fb_bf16 (likewise): the model itself in bf16 on both
//     sides (weights, activations and gradients).
//   qlora100m_shardN_*: with -n N, the same step with the NF4 base sharded
//     across N ranks against replicated (llm_shard.cpp).
//   qlora100m_B4_T512: one QLoRA training step of the same model (every
//     linear layer but lm_head in NF4, block 64, double quant; bf16 compute
//     where the CPU has bf16 products (cpu::bf16_gemm_native), else f32;
//     LoRA r 16, alpha 32, dropout 0.05 on all of them; forward, backward of
//     the causal-LM loss, AdamW on the adapters), against transformers +
//     bitsandbytes (load_in_4bit) + PEFT doing the same.
//   qlora100m_B4_T512_mixed (where the CPU has bf16 products): that step
//     in bf16 mixed precision, MixedPrecision against torch.autocast.
//   qlora100m_B4_T512_recompute: that step with each decoder layer
//     recomputed in the backward (finetune --recompute) against the peer
//     with gradient checkpointing (use_reentrant=False), as PEFT's QLoRA
//     recipe (prepare_model_for_kbit_training) sets it.
//   qlora100m_B4_T512_dora: that step with DoRA adapters (finetune
//     --use-dora) against PEFT's use_dora, both forming the extra frozen
//     product of the dropped input DoRA's training forward takes.
//   qlora100m_B4_T512_graph (on cuda and sim): that step (forward, backward,
//     AdamW) replayed as a captured graph (train/captured_step.h), its
//     tokens uploaded each step, against the peer's plain step.
//   qlora100m_B4_T512_peak_rss: the peak resident memory in MB of that step
//     (setup and two steps) in a fresh process on each side
//     (llm_peak_rss.cpp): ms and floor_ms hold MB.
// ratio = quanta / PyTorch: below 1 quanta is faster. The peer's python is
// $QUANTA_PEER_PYTHON, else /tmp/peer-venv/bin/python (../shared/peer/
// setup.sh); without it the rows say so. --size small shrinks every shape
// (a smoke test, not a measurement); --size large gives the QLoRA rows
// (qlora500m_B4_T512, its _peak_rss) and the sharding rows,
// qlora500m_shardN_*, of a ~517M Llama (1280 hidden, 24 layers, 20 heads,
// 3456 MLP), the latter at B 4 x T 128.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>

#include "bench.h"
#include "engine/cpu/block_cache.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/device_backend.h"
#include "engine/precision.h"
#include "llm/model/causal_lm.h"
#include "llm/model/lm_loss.h"
#include "llm/ops/attention.h"
#include "llm/qlora/qlora_model.h"
#include "quanta.h"
#include "quanta_config.h"
#include "train/captured_step.h"

namespace quanta::cli {
namespace {

// The PyTorch process: one request line in, one answer line out.
class Peer {
 public:
  Peer(const std::string& python, const std::string& script, int threads) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[1]);
      close(out[0]);
      const std::string t = std::to_string(threads);
      execl(python.c_str(), python.c_str(), script.c_str(), t.c_str(), nullptr);
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
    // A peer that dies (a python without torch) must not take this process
    // with it: writes to it then fail instead of raising SIGPIPE.
    signal(SIGPIPE, SIG_IGN);
  }
  ~Peer() {
    if (to_) {
      std::fputs("quit\n", to_);
      std::fclose(to_);
    }
    if (from_) std::fclose(from_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  /** The answer to one request; throws when the peer has ended. */
  std::string ask(const std::string& line) {
    char buf[256];
    if (std::fputs((line + "\n").c_str(), to_) < 0 || std::fflush(to_) != 0 ||
        !std::fgets(buf, sizeof buf, from_))
      throw std::runtime_error("the PyTorch peer ended (its stderr says why; request: " + line +
                               ")");
    std::string s(buf);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

std::string peer_python() {
  if (const char* p = std::getenv("QUANTA_PEER_PYTHON")) return p;
  return "/tmp/peer-venv/bin/python";
}

// The peer script beside the source tree the binary was built from, or
// $QUANTA_PEER_SCRIPT.
std::string peer_script() {
  if (const char* p = std::getenv("QUANTA_PEER_SCRIPT")) return p;
  return std::string(QUANTA_SOURCE_ROOT) + "/tools/peer/llm_bench_peer.py";
}

// The peer's word for where it runs: " cuda=1" on a GPU, nothing on the CPU.
std::string peer_device(Device device) { return device.is_cuda() ? " cuda=1" : ""; }

// Whether `device` multiplies bf16 faster than f32: the mixed-precision rows.
bool bf16_products(Device device) { return !device.is_cpu() || cpu::bf16_gemm_native(); }

// The QLoRA row's name and the peer's setup line, known before its model is
// made: --only decides from the name whether to make it.
struct QLoRARow {
  std::string name, peer_setup;
  int64_t b, t;
  int r;
  bool bf16;
};

QLoRARow qlora_row(const BenchOptions& o, const llm::DecoderConfig& c,
                   QLoRAVariant variant = QLoRAVariant::plain) {
  const bool mixed = variant == QLoRAVariant::mixed;
  const bool recompute = variant == QLoRAVariant::recompute;
  const bool dora = variant == QLoRAVariant::dora;
  QLoRARow row;
  row.b = o.small ? 2 : 4;
  row.t = o.small ? 32 : 512;
  row.r = o.small ? 4 : 16;
  // bf16 compute on a GPU (as QLoRA runs there) and where the CPU
  // multiplies bf16 natively, else f32; the peer is told the same.
  row.bf16 = !o.device.is_cpu() || cpu::bf16_gemm_native();
  const std::string shape = "_B" + std::to_string(row.b) + "_T" + std::to_string(row.t);
  row.name = "qlora" + llm_size_tag(o) + shape +
             (mixed                            ? "_mixed"
              : recompute                      ? "_recompute"
              : variant == QLoRAVariant::graph ? "_graph"
              : dora                           ? "_dora"
                                               : "");
  row.peer_setup = "setup qlora " + llm_peer_config(c) + " B=" + std::to_string(row.b) +
                   " T=" + std::to_string(row.t) + " r=" + std::to_string(row.r) +
                   " bf16=" + (row.bf16 ? "1" : "0") + (mixed ? " autocast=1" : "") +
                   (recompute ? " checkpointing=1" : "") + (dora ? " dora=1" : "") +
                   peer_device(o.device);
  return row;
}

// --only's filter: `want` says whether a row is asked for and records its
// name (for the error when none is), so each builder makes only the models
// and inputs of the rows it is asked for. --only is a regular expression
// found anywhere in a name (a plain name matches every row containing it;
// `qlora500m_B4_T512$` that row alone, `attention|qlora` either).
class RowFilter {
 public:
  explicit RowFilter(const std::string& only) : only_(only), pattern_(compile(only)) {}
  bool want(const std::string& name) {
    names_ += (names_.empty() ? "" : ", ") + name;
    const bool yes = matches(name);
    any_ = any_ || yes;
    return yes;
  }
  bool matches(const std::string& name) const { return std::regex_search(name, pattern_); }
  /** Throws when --only matched no row. */
  void check() const {
    if (!any_)
      throw std::invalid_argument("--only " + only_ + " matches no row of the llm suite (" +
                                  names_ + ")");
  }

 private:
  static std::regex compile(const std::string& only) {
    try {
      return std::regex(only, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw std::invalid_argument("--only " + only + " is not a regular expression: " + e.what());
    }
  }
  const std::string& only_;
  std::regex pattern_;
  std::string names_;
  bool any_ = false;
};

}  // namespace

std::string llm_size_tag(const BenchOptions& o) {
  return o.small ? "small" : o.large ? "500m" : "100m";
}

llm::DecoderConfig bench_llm_config(const BenchOptions& o) {
  // The ~110M Llama (small: 2 layers of 64; large: ~517M, 24 layers of 1280).
  llm::DecoderConfig c;
  c.vocab_size = o.small ? 512 : 32000;
  c.hidden_size = o.small ? 64 : o.large ? 1280 : 768;
  c.intermediate_size = o.small ? 128 : o.large ? 3456 : 2048;
  c.num_hidden_layers = o.small ? 2 : o.large ? 24 : 12;
  c.num_attention_heads = o.small ? 4 : o.large ? 20 : 12;
  c.num_key_value_heads = c.num_attention_heads;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  c.rope = {.theta = 10000, .head_dim = c.head_dim, .max_position_embeddings = 4096};
  return c;
}

LlmWorkload qlora_workload(const BenchOptions& o, const llm::DecoderConfig& c, Generator& gen,
                           QLoRAVariant variant) {
  const bool mixed = variant == QLoRAVariant::mixed, graph = variant == QLoRAVariant::graph;
  const QLoRARow row = qlora_row(o, c, variant);
  auto qmodel = std::shared_ptr<llm::CausalLM>(llm::CausalLM::random(c, gen));
  llm::QLoRAOptions q;
  q.lora.r = row.r;
  q.lora.lora_alpha = 2.0 * double(q.lora.r);
  q.lora.lora_dropout = 0.05;
  q.lora.use_dora = variant == QLoRAVariant::dora;
  q.quantization.compute_dtype = row.bf16 ? DType::bf16 : DType::f32;
  llm::apply_qlora(*qmodel, q);
  qmodel->set_recompute_layers(variant == QLoRAVariant::recompute);
  qmodel->to(o.device);
  std::vector<Tensor> adapters;
  for (const Tensor& p : qmodel->parameters())
    if (p.requires_grad()) adapters.push_back(p);
  auto opt = std::make_shared<AdamW>(adapters, AdamWOptions{.lr = 2e-4, .weight_decay = 0.0});
  const Tensor host_ids = randint(0, c.vocab_size, {row.b, row.t}, gen);
  if (graph) {
    // The batch uploaded each step, as a fine-tune's is; two steps as
    // called, then the forward, backward and AdamW step replayed.
    auto captured = std::make_shared<train::CapturedStep>(o.device, 2);
    auto forward_backward = [qmodel, mixed](const std::vector<Tensor>& in) {
      const MixedPrecision precision(mixed);
      Tensor loss = qmodel->lm_loss(qmodel->hidden_states(in.at(0)), in.at(0));
      loss.backward();
      return loss.detach();
    };
    return {row.name, row.peer_setup, [=] {
              captured->run(
                  {host_ids}, forward_backward, [opt] { opt->step(); }, {}, *opt);
            }};
  }
  auto ids = std::make_shared<Tensor>(host_ids.to(o.device));
  return {row.name, row.peer_setup, [=] {
            opt->zero_grad();
            {
              const MixedPrecision precision(mixed);
              qmodel->lm_loss(qmodel->hidden_states(*ids), *ids).backward();
            }
            opt->step();
          }};
}

std::string llm_peer_config(const llm::DecoderConfig& c) {
  return "vocab=" + std::to_string(c.vocab_size) + " hidden=" + std::to_string(c.hidden_size) +
         " ffn=" + std::to_string(c.intermediate_size) +
         " layers=" + std::to_string(c.num_hidden_layers) +
         " heads=" + std::to_string(c.num_attention_heads) +
         " kv_heads=" + std::to_string(c.num_key_value_heads);
}

namespace {

// The attention rows and the Llama forward (+ backward) rows that `filter`
// wants.
void add_attention_and_llama(const BenchOptions& o, const llm::DecoderConfig& c, Generator& gen,
                             RowFilter& filter, std::vector<LlmWorkload>& work) {
  // Attention: B 4, 12 heads of 64 (small: B 1, 2 heads of 16).
  const int64_t B = o.small ? 1 : 4, H = o.small ? 2 : 12, D = o.small ? 16 : 64;
  for (int64_t T : o.small ? std::vector<int64_t>{64} : std::vector<int64_t>{512, 2048}) {
    const std::string tag = "attention_T" + std::to_string(T);
    const bool fwd = filter.want(tag), fb_plain = filter.want(tag + "_fb");
    const bool fb_reference = o.device.is_cuda() && filter.want(tag + "_fb_reference");
    if (!fwd && !fb_plain && !fb_reference) continue;
    const auto input = [&] {
      return std::make_shared<Tensor>(randn({B, T, H, D}, gen).to(o.device).requires_grad_(true));
    };
    auto q = input(), k = input(), v = input();
    auto g = std::make_shared<Tensor>(randn({B, T, H, D}, gen).to(o.device));
    const std::string shape = "B=" + std::to_string(B) + " H=" + std::to_string(H) +
                              " T=" + std::to_string(T) + " D=" + std::to_string(D) +
                              peer_device(o.device);
    if (fwd)
      work.push_back({tag, "setup attention " + shape, [=] {
                        NoGradGuard no_grad;
                        llm::scaled_dot_product_attention(*q, *k, *v, {.causal = true});
                      }});
    auto fb = [=] {
      q->zero_grad(), k->zero_grad(), v->zero_grad();
      llm::scaled_dot_product_attention(*q, *k, *v, {.causal = true}).backward(*g);
    };
    if (fb_plain) work.push_back({tag + "_fb", "setup attention_fb " + shape, fb});
    // CUDA's warp-per-row reference kernels, which the default whole-matrix
    // products replaced (llm/cuda/attention.cu), against the same peer.
    if (fb_reference)
      work.push_back({tag + "_fb_reference", "setup attention_fb " + shape, [fb] {
                        setenv("QUANTA_CUDA_ATTENTION", "reference", 1);
                        fb();
                        unsetenv("QUANTA_CUDA_ATTENTION");
                      }});
  }
  const std::string cfg = llm_peer_config(c) + peer_device(o.device);
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      o.small ? std::vector<std::pair<int64_t, int64_t>>{{2, 32}}
              : std::vector<std::pair<int64_t, int64_t>>{{4, 512}, {1, 2048}};
  const auto llama_tag = [&](int64_t b, int64_t t) {
    return "llama" + llm_size_tag(o) + "_B" + std::to_string(b) + "_T" + std::to_string(t);
  };
  // Which of each shape's rows are wanted (forward, forward + backward, and
  // in bf16 mixed precision), before the model is made.
  std::vector<std::array<bool, 3>> wanted;
  bool any = false;
  for (const auto& [b, t] : shapes) {
    const std::string tag = llama_tag(b, t);
    // bf16 mixed precision on both sides: MixedPrecision's bf16 products
    // against PyTorch's autocast to bf16, on a GPU and where the CPU has
    // bf16 products.
    wanted.push_back({filter.want(tag), filter.want(tag + "_fb"),
                      bf16_products(o.device) && filter.want(tag + "_fb_mixed")});
    any = any || wanted.back()[0] || wanted.back()[1] || wanted.back()[2];
  }
  std::shared_ptr<llm::CausalLM> model;
  if (any) {
    model = std::shared_ptr<llm::CausalLM>(llm::CausalLM::random(c, gen));
    model->to(o.device);
  }
  for (std::size_t i = 0; any && i < shapes.size(); ++i) {
    const auto [b, t] = shapes[i];
    auto ids = std::make_shared<Tensor>(randint(0, c.vocab_size, {b, t}, gen).to(o.device));
    const std::string tag = llama_tag(b, t);
    const std::string shape = cfg + " B=" + std::to_string(b) + " T=" + std::to_string(t);
    if (wanted[i][0])
      work.push_back({tag, "setup llama_fwd " + shape, [=] {
                        NoGradGuard no_grad;
                        model->logits(*ids);
                      }});
    if (wanted[i][1])
      work.push_back({tag + "_fb", "setup llama_fb " + shape, [=] {
                        for (const Tensor& p : model->parameters()) p.zero_grad();
                        llm::causal_lm_loss(model->logits(*ids), *ids).backward();
                      }});
    if (wanted[i][2])
      work.push_back({tag + "_fb_mixed", "setup llama_fb " + shape + " autocast=1", [=] {
                        for (const Tensor& p : model->parameters()) p.zero_grad();
                        const MixedPrecision mixed;
                        llm::causal_lm_loss(model->logits(*ids), *ids).backward();
                      }});
  }
  // The model in bf16 (weights, activations, gradients: a config whose
  // torch_dtype is bfloat16) on both sides, at the first shape, where the
  // device multiplies bf16 directly.
  const auto [b, t] = shapes.front();
  const std::string tag = llama_tag(b, t);
  if (!bf16_products(o.device) || !filter.want(tag + "_fb_bf16")) return;
  auto model16 = std::shared_ptr<llm::CausalLM>(llm::CausalLM::random(c, gen));
  model16->to(DType::bf16);
  model16->to(o.device);
  auto ids = std::make_shared<Tensor>(randint(0, c.vocab_size, {b, t}, gen).to(o.device));
  work.push_back(
      {tag + "_fb_bf16",
       "setup llama_fb " + cfg + " B=" + std::to_string(b) + " T=" + std::to_string(t) + " bf16=1",
       [=] {
         for (const Tensor& p : model16->parameters()) p.zero_grad();
         llm::causal_lm_loss(model16->logits(*ids), *ids).backward();
       }});
}

// The QLoRA step's peak resident memory, quanta's (a child process) against
// PyTorch's (a child of the peer) in MB. The peer goes first: asked, it
// drops its own workloads, so no two models share the machine's memory.
BenchRow peak_rss_row(const BenchOptions& o, const std::string& name, const std::string& request,
                      Peer* peer, const std::string& why) {
  BenchRow row{name};
  row.unit = "MB";
  std::string peer_failed;
  if (peer) {
    const std::string answer = peer->ask(request);
    char* end = nullptr;
    row.floor_ms = std::strtod(answer.c_str(), &end);
    if (end == answer.c_str() || !(row.floor_ms > 0))
      peer_failed = "the PyTorch peer could not measure its peak: " + answer;
  }
  try {
    row.ms = qlora_peak_rss_mb(o);
  } catch (const std::exception& e) {
    return unavailable_row(name, e.what());
  }
  if (!peer) row.unavailable = why;
  if (!peer_failed.empty()) row.unavailable = peer_failed;
  return row;
}

}  // namespace

std::vector<BenchRow> bench_llm(const BenchOptions& o) {
  if (run_as_peak_rss_child(o)) return {};
  std::vector<LlmWorkload> work;
  Generator gen(321);
  const llm::DecoderConfig c = bench_llm_config(o);
  RowFilter filter(o.only);
  // ~500M: the QLoRA step and the sharding rows only.
  if (!o.large) add_attention_and_llama(o, c, gen, filter, work);
  // QLoRA: a model of its own, converted; its peak memory in a process of
  // its own on each side.
  const QLoRARow qlora = qlora_row(o, c);
  if (filter.want(qlora.name)) work.push_back(qlora_workload(o, c, gen));
  // The same step in bf16 mixed precision on both sides (quanta finetune
  // --precision bf16; PyTorch's autocast), on a GPU and where the CPU has
  // bf16 products.
  if (bf16_products(o.device) && filter.want(qlora_row(o, c, QLoRAVariant::mixed).name))
    work.push_back(qlora_workload(o, c, gen, QLoRAVariant::mixed));
  // With the layers recomputed in the backward on both sides (finetune
  // --recompute; PEFT's QLoRA recipe turns on gradient checkpointing).
  if (filter.want(qlora_row(o, c, QLoRAVariant::recompute).name))
    work.push_back(qlora_workload(o, c, gen, QLoRAVariant::recompute));
  // DoRA on both sides (finetune --use-dora; PEFT's use_dora).
  if (filter.want(qlora_row(o, c, QLoRAVariant::dora).name))
    work.push_back(qlora_workload(o, c, gen, QLoRAVariant::dora));
  // On a device that records: the plain step as a graph, against the same
  // PyTorch step.
  if (!o.device.is_cpu() && device_backend(o.device.type).graph &&
      filter.want(qlora_row(o, c, QLoRAVariant::graph).name))
    work.push_back(qlora_workload(o, c, gen, QLoRAVariant::graph));
  // The peak resident memory and the sharding rows are the CPU's.
  const bool cpu_rows = o.device.is_cpu();
  const std::string peak_name = qlora.name + "_peak_rss";
  const bool peak_wanted = cpu_rows && filter.want(peak_name);
  bool shard_wanted = false;
  if (cpu_rows)
    for (const std::string& name : llm_shard_row_names(o))
      shard_wanted = filter.want(name) || shard_wanted;
  filter.check();
  std::unique_ptr<Peer> peer;
  std::string why;
  if (o.device.is_sim())
    why = "sim has no PyTorch peer (its kernels are the CPU's: the CPU rows compare)";
  else if (!std::filesystem::exists(peer_python()))
    why = "no PyTorch peer: " + peer_python() +
          " is missing (run ../shared/peer/setup.sh or set QUANTA_PEER_PYTHON)";
  else if (!std::filesystem::exists(peer_script()))
    why = "no peer script at " + peer_script() + " (set QUANTA_PEER_SCRIPT)";
  else
    peer = std::make_unique<Peer>(peer_python(), peer_script(), num_threads());

  std::vector<BenchRow> rows;
  for (LlmWorkload& slot : work) {
    // What a row holds (its model, gradients, inputs) goes with it once it
    // has run: the Llama model and its gradients are gone before the QLoRA
    // step, whose activations then fit beside what is left.
    LlmWorkload w = std::move(slot);
    // On a device a call ends when its work is done, not when it is queued.
    if (!o.device.is_cpu())
      w.run = [run = w.run, device = o.device] {
        run();
        synchronize(device);
      };
    // quanta's side once first: a step that cannot run here (a kernel the
    // device lacks, a step that cannot be captured) leaves its row
    // unavailable, saying why, and the suite goes on.
    try {
      w.run();
    } catch (const std::exception& e) {
      rows.push_back(unavailable_row(w.name, e.what()));
      continue;
    }
    BenchRow row{w.name};
    if (!peer) {
      row.ms = median_ms(o.repeat, w.run);
      row.unavailable = why;
      rows.push_back(row);
      continue;
    }
    try {
      const std::string setup = peer->ask(w.peer_setup);
      if (setup != "ok") {  // quanta's side still runs
        row.ms = median_ms(o.repeat, w.run);
        row.unavailable = "the PyTorch peer refused setup: " + setup;
        rows.push_back(row);
        continue;
      }
      const std::string name = w.peer_setup.substr(6, w.peer_setup.find(' ', 6) - 6);
      const std::vector<double> ms =
          interleaved_ms(o.repeat, 1, {w.run, [&] { peer->ask("time " + name + " 1"); }});
      row.ms = ms[0];
      row.floor_ms = ms[1];
    } catch (const std::runtime_error& e) {
      // The peer is gone: this row and the rest keep quanta's side.
      why = e.what();
      peer.reset();
      row.ms = median_ms(o.repeat, w.run);
      row.unavailable = why;
    }
    rows.push_back(row);
  }
  // The CPU block cache's kept blocks go back now: the peak rows' fresh
  // processes measure alone (the peer drops its own workloads when asked),
  // and the sharding rows' ranks run on sim devices, whose memory is their
  // own.
  cpu::release_cached_blocks();
  if (!cpu_rows) return rows;
  if (peak_wanted)
    rows.push_back(
        peak_rss_row(o, peak_name, "peak" + qlora.peer_setup.substr(5), peer.get(), why));
  // Sharding against replication needs no peer: both are quanta's. Its
  // replicas (N ranks, sharded and replicated) come on top of whatever is
  // still alive, so the models above and the peer's process go first.
  work.clear();
  peer.reset();
  if (shard_wanted) {
    for (BenchRow& r : bench_llm_shard(o, c))
      if (filter.matches(r.name)) rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace quanta::cli
