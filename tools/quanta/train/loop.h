#pragma once
// The one training loop of the `quanta` command. The VQ-VAE (trainer.cpp),
// the classifier (classify.cpp) and the LoRA fine-tune (finetune.cpp) each
// describe their task (model, loss, evaluation, what a checkpoint keeps) and
// hand it to run_loop, which does the rest the same way for all three:
//   - batches: the global batch of step s is BatchOrder's (a pure function of
//     seed and step), each rank takes its contiguous share;
//   - the step: zero_grad, backward (over --grad-accum micro-batches, one
//     gradient average), DataParallel's gradient average, clipping, the
//     schedule's lr, Adam or AdamW, the task's after_step();
//   - one all-reduce per step carrying the logged losses and whether any rank
//     was asked to stop, so every rank stops after the same step;
//   - the divergence check (a non-finite loss stops the run with its step);
//   - progress lines or bar, metrics.jsonl (a header record at every start,
//     "train" records every --log-every steps, "eval" records), with the
//     log window kept across --resume;
//   - evaluation and checkpoint at the task's cadence and at the end, on
//     rank 0 only; SIGINT / SIGTERM finish the step, write the checkpoint and
//     return; --resume restores model, optimizer, the task's extra state and
//     the metrics history, and continues exactly.
#include <array>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/data_parallel.h"
#include "dist/process_group.h"
#include "engine/nn/module.h"
#include "engine/profile/call_profile.h"
#include "engine/tensor.h"

namespace quanta::train {

/** This rank's share of a step's global batch (with gradient accumulation:
 * of one micro-batch of it). */
struct BatchShare {
  Tensor rows;              // positions into the training set, this rank's
  int64_t global_rows = 0;  // rows of the whole (global) batch
  int world = 1;            // ranks sharing it
  Tensor batch;             // the whole global batch's positions (every rank's)
  /** The task's step_inputs() for these rows, on the model's device (when
   * the step is a graph: the same tensors every step, the batch copied in). */
  std::vector<Tensor> inputs;
};

/** What one step's forward reports. `loss` is back-propagated; it and every
 * term are this rank's part, scaled so that their sum over the ranks (and
 * over the micro-batches of an accumulated step) divided by the world size
 * is the whole batch's value (then DataParallel's average of the gradients
 * is the whole batch's gradient, however the batch splits). */
struct StepLoss {
  Tensor loss;
  /** Values of the task's term_names(), in order (scalars; detached or not). */
  std::vector<Tensor> terms;
};

/** What an evaluation reports (rank 0). */
struct Evaluation {
  /** Fields of the "eval" record of metrics.jsonl besides kind, step, epoch,
   * lr and elapsed_s. */
  nlohmann::json fields = nlohmann::json::object();
  /** The progress line after "eval step S (epoch E): ". */
  std::string line;
};

/** A figure derived from a log window's mean terms: a field of the "train"
 * record and a part of the progress line. */
struct WindowMetric {
  std::string name;  // the record's field
  double value = 0;
  std::string text;  // on the progress line, e.g. "psnr 21.37 dB"
};

/** The task-specific half of a run. */
class LoopTask {
 public:
  virtual ~LoopTask() = default;
  /** The model: trained (its parameters with requires_grad), wrapped in
   * DataParallel when there are several ranks, and checkpointed through
   * state() unless the task overrides it. */
  virtual std::shared_ptr<Module> model() = 0;
  /** Once the run knows where it starts (`start_step` > 0 after --resume)
   * and ends (`total_steps`): the lines saying what is trained on what,
   * written to rank 0's log (the other ranks' log discards them). */
  virtual void describe(std::ostream& log, int64_t start_step, int64_t total_steps) const = 0;
  /** The metrics names of StepLoss::terms ("recon_mse", ...). */
  virtual std::vector<std::string> term_names() const { return {}; }
  /** Figures derived from a log window's mean terms (in term_names() order),
   * e.g. a PSNR from a reconstruction error; none by default. */
  virtual std::vector<WindowMetric> window_metrics(
      const std::vector<double>& /*mean_terms*/) const {
    return {};
  }
  /** The host half of a step: the tensors its forward reads, gathered for
   * this rank's share on the host (the images of its rows). The loop moves
   * them to the model's device and hands them to step() in
   * BatchShare::inputs; a task that returns none reads its batch itself. */
  virtual std::vector<Tensor> step_inputs(const BatchShare& /*share*/) { return {}; }
  /** Whether step() may be captured as a graph (LoopSettings::graph): it
   * reads its batch only from BatchShare::inputs, and nothing a kernel is
   * given depends on the batch's contents except through the inputs' count
   * and shapes (a step that takes another path returns other inputs, so
   * that a graph of one path never replays for the other). */
  virtual bool capturable_step() const { return false; }
  /** Forward of this rank's share of the step's batch. When the step is a
   * graph, this is called once, at the capture; everything else replays
   * what it queued on the device (engine/capture/device_graph.h). */
  virtual StepLoss step(const BatchShare& share) = 0;
  /** After every optimizer step, on every rank. */
  virtual void after_step() {}
  /** Whether after_step() joins a captured step's graph (one rank): it
   * reads nothing back from the device, and what it changes on the host it
   * makes again at each replay (on_replay). */
  virtual bool capturable_after_step() const { return false; }
  /** Evaluates the model on rank 0; called in train mode, which the loop
   * restores afterwards. */
  virtual Evaluation evaluate() = 0;
  /** Rank 0 after each checkpoint: the task's other outputs (pictures),
   * given the metrics records so far. */
  virtual void write_outputs(const std::vector<nlohmann::json>& /*history*/, bool /*evaluated*/) {}
  /** The tensors a checkpoint keeps of the model (default: its state dict)
   * and how they are restored. */
  virtual StateDict state();
  virtual void load_state(const StateDict& state);
  /** Figures a checkpoint records in its "results" metadata (written when
   * not empty; the classifier's test accuracy after its evaluation). */
  virtual nlohmann::json results() const { return nlohmann::json::object(); }
  /** State that is neither parameter nor buffer (random streams' offsets),
   * kept in the checkpoint's "rng" metadata beside "seed". */
  virtual nlohmann::json extra_state() const { return nlohmann::json::object(); }
  virtual void load_extra_state(const nlohmann::json& /*rng*/) {}
};

/** The optimizer and what shapes its steps. */
struct OptimizerSettings {
  /** AdamW (decoupled weight decay) instead of Adam. */
  bool adamw = false;
  double weight_decay = 0;
  /** Which trainable tensors, by name, weight decay applies to (empty: all);
   * the others form a second group at 0. */
  std::function<bool(const std::string& name)> decays;
  /** "constant", "linear" (to 0 at the last step) or "cosine" (to 0), each
   * after `warmup_steps` of linear warmup. */
  std::string schedule = "constant";
  int64_t warmup_steps = 0;
  /** Adam's beta1 and beta2, and its epsilon (PyTorch's defaults). */
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  /** Clip the gradients' joint 2-norm to this before each step (0: no). */
  double max_grad_norm = 0;
  /** Micro-batches per step: each rank's share is split into this many
   * forward/backward passes, their gradients summed, averaged across ranks
   * once. */
  int64_t grad_accum = 1;
};

/** The trainable tensors of `model` (requires_grad), by name: what a
 * fine-tune's checkpoint keeps of the model (the adapters). */
StateDict trainable_state(Module& model);
/** Copies them back; a missing or mis-shaped one throws std::runtime_error
 * naming it, `hint` saying what may differ ("another --lora-r?"). */
void load_trainable_state(Module& model, const StateDict& state, const std::string& hint);

/** The states of the generators `model`'s layers draw from in training
 * (Module::own_random_streams, e.g. LoRA dropout), by module name, as JSON:
 * a checkpoint keeps them so that a resumed run draws the same numbers. */
nlohmann::json random_stream_states(Module& model);
/** Restores them; a layer the checkpoint has no state for throws
 * std::runtime_error naming it. */
void load_random_stream_states(Module& model, const nlohmann::json& states);

/** --profile: the kernel-table calls of some steps, counted and timed per
 * entry (engine/profile/call_profile.h), then printed on the log and kept
 * in metrics.jsonl as a "profile" record. */
struct ProfileSettings {
  /** Steps to profile (0: none): those after the run's first two (the
   * first initialises, the second is the first steady one), or the last
   * ones of a shorter run. Profiled steps run as called, never as a graph. */
  int64_t steps = 0;
  CallTiming timing = CallTiming::host;
  /** Where the lead rank writes the window's calls as a Chrome trace
   * (chrome://tracing, ui.perfetto.dev) beside the report; empty: none. */
  std::string trace_path;
};

/** How to run a task. */
struct LoopSettings {
  /** Output folder: checkpoint.safetensors and metrics.jsonl go there. */
  std::string out_dir;
  /** Continue from out_dir's checkpoint (its config must be this run's). */
  bool resume = false;
  bool progress_bar = false;
  /** Training set size, global batch, total steps, data-order seed. */
  int64_t examples = 0, batch_size = 1, total_steps = 1;
  uint64_t seed = 0;
  /** Steps per "train" record and log line. */
  int64_t log_every = 100;
  /** Steps between evaluations + checkpoints: 0 each epoch, kEvalAtEnd only
   * at the end. */
  int64_t eval_every = 0;
  /** The optimizer's (peak) learning rate. */
  double lr = 1e-3;
  OptimizerSettings optimizer{};
  /** What a step's throughput counts: `throughput_unit` ("img", "tokens";
   * the train record's field is "<unit>_per_s"), `items_per_row` of them per
   * row of the batch. */
  std::string throughput_unit = "img";
  int64_t items_per_row = 1;
  /** Checkpoint format tag and the config object it keeps. */
  std::string checkpoint_format;
  nlohmann::json checkpoint_config;
  /** Fields of every start's header record besides kind, step and resumed
   * (config, version, threads, device, world size, ...). */
  nlohmann::json header = nlohmann::json::object();
  /** DataParallel's options when there are several ranks. */
  dist::DataParallelOptions data_parallel{};
  /** With several ranks: each rank keeps the averaged gradients and the
   * optimizer state of its share of the trainable parameters only
   * (dist::OptimizerShards); same results, checkpoints in the ordinary
   * layout. */
  bool shard_optimizer_state = false;
  /** bf16 products (engine/precision.h's MixedPrecision) in every step's
   * forward and backward and in evaluation. */
  bool mixed_precision = false;
  /** The step (its micro-batches' forwards and backwards, clipping, the
   * optimizer and, where it can be, the task's after_step) as one captured
   * graph on a device that records (CUDA, sim), with one rank, when the
   * task's step is capturable (train/captured_step.h); the same bits
   * either way. */
  bool graph = true;
  /** Steps profiled, and how (above). */
  ProfileSettings profile{};
  /** "training" or "fine-tuning": how a divergence message starts. */
  std::string activity = "training";
};

inline constexpr int64_t kEvalAtEnd = -1;

/** How a run ended. */
struct LoopResult {
  int64_t step = 0;  // optimizer steps done in total
  bool interrupted = false;
  /** The last evaluation's fields (empty when none ran, or not rank 0). */
  nlohmann::json last_eval = nlohmann::json::object();
};

/** `log` on the rank that speaks for the run (`lead`), a stream that
 * discards everything on the others: how every rank writes "rank 0's" lines
 * without a branch at each. */
std::ostream& lead_log(std::ostream& log, bool lead);

/** Runs (or resumes) `task` under `settings` on the ranks of `group`,
 * printing on `log` (pass rank 0's stream; other ranks' output is dropped).
 * Throws std::invalid_argument on a resume past the run's end, and
 * std::runtime_error when training diverges. */
LoopResult run_loop(LoopTask& task, const LoopSettings& settings, dist::ProcessGroup& group,
                    std::ostream& log);

}  // namespace quanta::train
