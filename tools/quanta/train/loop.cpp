#include "train/loop.h"

#include <signal.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <streambuf>
#include <vector>

#include "dist/optimizer_shards.h"
#include "engine/autograd/grad_mode.h"
#include "engine/cpu/parallel.h"
#include "engine/device_backend.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "engine/optim/optimizer.h"
#include "engine/optim/schedule.h"
#include "engine/precision.h"
#include "train/batch_order.h"
#include "train/captured_step.h"
#include "train/checkpoint.h"
#include "train/outputs.h"
#include "train/progress.h"
#include "train/step_profile.h"

namespace quanta::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The one piece of state a signal handler may touch.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installs the SIGINT / SIGTERM handlers for the life of a run. SA_RESETHAND:
// a second Ctrl-C gets the default action, so a stuck run can still be killed.
// SA_ONSTACK, on a stack of its own: a signal frame pushed on the running
// thread's stack overwrote what oneDNN's JIT sgemm keeps below its stack
// pointer, and glibc aborted on a corrupted heap inside it (73 of 3198
// SIGTERM runs of the train CLI test under load; none of 1455 without the
// signal).
class StopSignals {
 public:
  StopSignals() : alt_stack_(kAltStackBytes) {
    g_stop_signal = 0;
    stack_t ss{};
    ss.ss_sp = alt_stack_.data();
    ss.ss_size = alt_stack_.size();
    on_alt_stack_ = sigaltstack(&ss, &old_stack_) == 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND | (on_alt_stack_ ? SA_ONSTACK : 0);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    if (on_alt_stack_) sigaltstack(&old_stack_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int caught() const { return g_stop_signal; }

 private:
  static constexpr std::size_t kAltStackBytes = 64 << 10;
  std::vector<char> alt_stack_;
  stack_t old_stack_{};
  bool on_alt_stack_ = false;
  struct sigaction old_int_ {
  }, old_term_{};
};

// The sums behind the next "train" record of metrics.jsonl. A window runs
// from one multiple of --log-every to the next, whatever happens between
// (an evaluation, an interruption, the end of a run that a resume extends):
// the checkpoint keeps the partial sums, so the first record after --resume
// averages the steps an uninterrupted run's record would.
struct LogWindow {
  int64_t first_step = 1;  // the first step it covers
  double loss = 0;
  std::vector<double> terms;  // the task's terms, in term_names() order
  int64_t steps = 0;

  explicit LogWindow(std::size_t n_terms, int64_t first = 1) : first_step(first), terms(n_terms) {}

  json to_json(const std::vector<std::string>& names) const {
    if (steps == 0) return json::object();
    json j = {{"first_step", first_step}, {"loss_sum", loss}, {"steps", steps}};
    for (std::size_t i = 0; i < names.size(); ++i) j[names[i] + "_sum"] = terms[i];
    return j;
  }
  // The window a checkpoint at `step` left, when it belongs to the window
  // this run's --log-every opens at the last multiple before `step`; else
  // (another --log-every, or a checkpoint without the sums) a fresh one.
  static LogWindow restore(const json& j, const std::vector<std::string>& names, int64_t step,
                           int64_t log_every) {
    LogWindow w(names.size(), step / log_every * log_every + 1);
    const bool same = !j.empty() && j.value("first_step", int64_t{0}) == w.first_step;
    bool complete = same && j.contains("loss_sum") && j.contains("steps");
    for (const std::string& name : names) complete = complete && j.contains(name + "_sum");
    if (!complete) return LogWindow(names.size(), step + 1);
    w.loss = j.at("loss_sum").get<double>();
    w.steps = j.at("steps").get<int64_t>();
    for (std::size_t i = 0; i < names.size(); ++i) w.terms[i] = j.at(names[i] + "_sum");
    return w;
  }
};

// The trainable tensors in the optimizer's groups, each in model order:
// those weight decay applies to, then (with weight decay and a `decays`
// rule) the others, at 0.
std::vector<ParamGroup> optimizer_groups(Module& model, const LoopSettings& s) {
  const OptimizerSettings& o = s.optimizer;
  ParamGroup decayed, undecayed;
  undecayed.weight_decay = 0.0;
  for (auto& [name, p] : model.named_parameters()) {
    if (!p.requires_grad()) continue;
    const bool decays = o.weight_decay == 0 || !o.decays || o.decays(name);
    (decays ? decayed : undecayed).params.push_back(p);
  }
  std::vector<ParamGroup> out;
  if (!decayed.params.empty() || undecayed.params.empty()) out.push_back(std::move(decayed));
  if (!undecayed.params.empty()) out.push_back(std::move(undecayed));
  return out;
}

// The groups' parameters one after the other: the optimizer's order.
std::vector<Tensor> group_parameters(const std::vector<ParamGroup>& groups) {
  std::vector<Tensor> out;
  for (const ParamGroup& g : groups) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

std::unique_ptr<Adam> make_optimizer(std::vector<ParamGroup> groups, const LoopSettings& s) {
  const OptimizerSettings& o = s.optimizer;
  if (o.adamw)
    return std::make_unique<AdamW>(
        std::move(groups),
        AdamWOptions{.lr = s.lr, .betas = o.betas, .eps = o.eps, .weight_decay = o.weight_decay});
  return std::make_unique<Adam>(
      std::move(groups),
      AdamOptions{.lr = s.lr, .betas = o.betas, .eps = o.eps, .weight_decay = o.weight_decay});
}

// The lr of each step, a pure function of the step (so a resumed run
// continues the curve); "constant" with no warmup is the lr itself.
std::unique_ptr<LrSchedule> make_schedule(Optimizer& opt, const LoopSettings& s) {
  const OptimizerSettings& o = s.optimizer;
  if (o.schedule == "linear")
    return std::make_unique<WarmupLinearDecay>(opt, o.warmup_steps, s.total_steps);
  if (o.schedule == "cosine")
    return std::make_unique<WarmupCosine>(opt, o.warmup_steps, s.total_steps);
  if (o.schedule == "constant") return std::make_unique<LinearWarmup>(opt, o.warmup_steps);
  throw std::invalid_argument("--lr-schedule must be constant, linear or cosine, got \"" +
                              o.schedule + "\"");
}

// Steps run as called before the step is captured: the first ones change
// what a step queues (k-means initialisation on the first update, the
// optimizer's state made by its first step).
constexpr int64_t kGraphWarmupSteps = 2;

// Entries --profile's report names, the most time first.
constexpr std::size_t kProfileLines = 25;

Device model_device(Module& model) {
  for (const Tensor& p : model.parameters()) return p.device();
  return Device::cpu();
}

std::string signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "another rank";
}

// One run of run_loop: the state its steps share, and the steps as named
// functions.
class Loop {
 public:
  Loop(LoopTask& task, const LoopSettings& s, dist::ProcessGroup& group, std::ostream& log)
      : task_(task),
        s_(s),
        group_(group),
        rank_(group.rank()),
        world_(group.size()),
        lead_(rank_ == 0),
        log_(lead_log(log, lead_)),
        model_(task.model()),
        names_(task.term_names()),
        optimizer_(make_optimizer(optimizer_groups(*model_, s), s)),
        schedule_(make_schedule(*optimizer_, s)),
        per_epoch_((s.examples + s.batch_size - 1) / s.batch_size),
        ckpt_path_(out_file(s.out_dir, kCheckpointFile)),
        metrics_path_(out_file(s.out_dir, kMetricsFile)),
        window_(names_.size()),
        order_(s.seed, s.examples, s.batch_size),
        device_(model_device(*model_)),
        started_(std::chrono::steady_clock::now()) {
    if (graphs_step()) captured_ = std::make_unique<CapturedStep>(device_, kGraphWarmupSteps);
    if (world_ > 1) dp_ = std::make_unique<dist::DataParallel>(model_, group_, s.data_parallel);
    if (world_ > 1 && s.shard_optimizer_state) {
      std::vector<std::size_t> sizes;
      for (const ParamGroup& g : optimizer_->param_groups()) sizes.push_back(g.params.size());
      opt_shards_ = std::make_unique<dist::OptimizerShards>(
          group_, group_parameters(optimizer_->param_groups()), std::move(sizes));
      opt_shards_->reduce_gradients_to_owners(*dp_);
    }
  }

  LoopResult run() {
    if (lead_) fs::create_directories(s_.out_dir);
    if (s_.resume) restore();
    write_header();
    task_.describe(log_, step_, s_.total_steps);
    if (sharded())
      log_ << "sharded: " << dp_->sharded()->full_bytes() << " bytes of frozen base state, "
           << dp_->sharded()->shard_bytes() << " kept per rank, gathered by "
           << dp_->sharded()->unit_names().size() << " units just in time\n";
    if (opt_shards_)
      log_ << "optimizer state and gradients sharded: rank 0 keeps them for "
           << opt_shards_->owned_elements() << " of " << opt_shards_->total_elements()
           << " trainable elements\n";
    Progress progress(log_, s_.progress_bar, step_, s_.total_steps,
                      s_.batch_size * s_.items_per_row, s_.throughput_unit);
    progress_ = &progress;
    StopSignals signals;
    StepProfile profile(s_.profile, device_, step_, s_.total_steps);
    model_->train();
    LoopResult result;
    while (step_ < s_.total_steps) {
      profile.before(step_ + 1);
      const auto step_start = std::chrono::steady_clock::now();
      const bool stop = train_step(signals.caught() != 0);
      const double step_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      if (profile.after(step_seconds, stop || step_ == s_.total_steps)) report_profile(profile);
      log_step(stop);
      if (stop) {
        const StateDict optimizer_state = gathered_optimizer_state();
        if (lead_) save_and_write_outputs(false, optimizer_state);
        progress.line("interrupted by " + signal_name(signals.caught()) + " after step " +
                      std::to_string(step_) + "; checkpoint written to " + ckpt_path_ +
                      " (continue with --resume --out " + s_.out_dir + ")");
        result.interrupted = true;
        break;
      }
      if (eval_due()) {
        const StateDict optimizer_state = gathered_optimizer_state();
        if (lead_ || sharded()) result.last_eval = evaluate(optimizer_state);
      }
    }
    progress.finish();
    // The caller gets its model whole (a merge reads the base).
    if (dp_ && !result.interrupted) dp_->unshard();
    progress_ = nullptr;
    result.step = step_;
    return result;
  }

 private:
  // --resume: model, optimizer, the task's streams, the step, the log window
  // and the metrics records up to the checkpoint.
  void restore() {
    Checkpoint ck = load_checkpoint(ckpt_path_, s_.checkpoint_format);
    task_.load_state(ck.model);
    optimizer_->load_state_dict(opt_shards_ ? opt_shards_->owned_state(ck.optimizer)
                                            : ck.optimizer);
    task_.load_extra_state(ck.info.rng);
    step_ = ck.info.step;
    window_ = LogWindow::restore(ck.info.log_window, names_, step_, s_.log_every);
    // Records past the checkpoint belong to steps that will run again.
    for (json& r : read_metrics(metrics_path_))
      if (r.value("step", int64_t{0}) <= step_) history_.push_back(std::move(r));
    group_.barrier();  // every rank has read the files before rank 0 rewrites them
    if (step_ >= s_.total_steps)
      throw std::invalid_argument("--resume: the checkpoint is at step " + std::to_string(step_) +
                                  ", the run asks for " + std::to_string(s_.total_steps) +
                                  " steps; raise --steps or --epochs");
  }

  // Each start of the run (the first and every --resume) opens the metrics
  // with a header: what ran, where and how, so the file explains itself.
  void write_header() {
    if (!lead_) return;
    json header = s_.header;
    header["kind"] = "header";
    header["step"] = step_;
    header["resumed"] = s_.resume;
    header["threads"] = num_threads();
    header["world_size"] = world_;
    header["graph"] = captured_ != nullptr;
    history_.push_back(std::move(header));
    write_metrics(metrics_path_, history_);
  }

  // One optimizer step on this rank's share of the global batch. The logged
  // values stay where the model is: a device's are read once per log window
  // (flush_values), so a step never waits for it; the CPU's every step. With
  // several ranks, one host all-reduce per step says whether any rank was
  // asked to stop (`stop_here`). Returns whether the run stops after this
  // step.
  bool train_step(bool stop_here) {
    const int64_t syncs_before = host_sync_count();
    const Tensor batch = order_.batch(step_);
    const Tensor share = rank_share(batch, rank_, world_);
    // Micro-batches: contiguous pieces of this rank's share; gradients
    // accumulate locally and are averaged across ranks once, at the end.
    // Every rank runs as many as the largest share needs, some of them
    // empty on a smaller share (an empty piece adds exact zeros): a sharded
    // model's forwards are collectives, so their count must agree.
    int64_t largest = 0;
    for (int r = 0; r < world_; ++r)
      largest = std::max(largest, rank_share(batch, r, world_).numel());
    const int64_t pieces = std::max<int64_t>(1, std::min(s_.optimizer.grad_accum, largest));
    std::vector<Tensor> values;
    // Clipping and the optimizer step: in a captured step's graph, else
    // after the pieces (the task's after_step too where it can be).
    auto update = [&] {
      // Sharded, each rank holds its own parameters' gradients only.
      if (s_.optimizer.max_grad_norm > 0 && opt_shards_)
        opt_shards_->clip_grad_norm_(s_.optimizer.max_grad_norm);
      else if (s_.optimizer.max_grad_norm > 0)  // the norm is not logged: not read
        clip_grad_norm_no_sync_(group_parameters(optimizer_->param_groups()),
                                s_.optimizer.max_grad_norm);
      optimizer_->step();
      if (opt_shards_) opt_shards_->broadcast_updates();
    };
    std::vector<BatchShare> piece_of(static_cast<std::size_t>(pieces));
    std::vector<std::vector<Tensor>> host_inputs(static_cast<std::size_t>(pieces));
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t lo = share.numel() * p / pieces;
      const int64_t hi = share.numel() * (p + 1) / pieces;
      piece_of[p] = {slice(share, 0, lo, hi), batch.numel(), world_, batch, {}};
      host_inputs[p] = task_.step_inputs(piece_of[p]);
    }
    // Piece p's forward and backward on its inputs (on the device); returns
    // the values to log. On a graph's replay it does not run: the device
    // repeats what it queued at the capture.
    auto forward_backward = [&](int64_t p, const std::vector<Tensor>& inputs) {
      BatchShare& piece = piece_of[p];
      piece.inputs = inputs;
      // The backward runs in the precision each op's forward ran in.
      const StepLoss out = [&] {
        const MixedPrecision precision(s_.mixed_precision);
        return task_.step(piece);
      }();
      {
        std::optional<dist::DataParallel::NoSync> local;
        if (dp_ && p + 1 < pieces) local.emplace(*dp_);
        out.loss.backward();
      }
      NoGradGuard no_grad;
      std::vector<Tensor> v = {out.loss.detach()};
      for (const Tensor& t : out.terms) v.push_back(t.detach());
      return to_dtype(stack(v), DType::f64);
    };
    if (captured_) {
      // Every piece, the update and (where it can) the task's after_step in
      // one graph, whose inputs are the pieces' inputs one after another; a
      // replay reads the lr set here.
      std::vector<Tensor> all_inputs;
      for (const auto& in : host_inputs) all_inputs.insert(all_inputs.end(), in.begin(), in.end());
      auto body = [&](const std::vector<Tensor>& inputs) {
        Tensor sum;
        std::size_t at = 0;
        for (int64_t p = 0; p < pieces; ++p) {
          const std::size_t n = host_inputs[p].size();
          const std::vector<Tensor> mine(inputs.begin() + at, inputs.begin() + at + n);
          at += n;
          const Tensor v = forward_backward(p, mine);
          sum = p == 0 ? v : sum + v;
        }
        return sum;
      };
      optimizer_->set_lr(schedule_->lr_at(step_));
      std::function<void()> after;
      if (task_.capturable_after_step()) after = [&] { task_.after_step(); };
      values.push_back(captured_->run(all_inputs, body, update, after, *optimizer_));
    } else {
      optimizer_->zero_grad();
      for (int64_t p = 0; p < pieces; ++p) {
        std::vector<Tensor> inputs;
        for (const Tensor& t : host_inputs[p]) inputs.push_back(t.to(device_));
        values.push_back(forward_backward(p, inputs));
      }
    }
    const Device loss_device = values[0].device();
    report_graph();
    if (!captured_) {
      if (dp_) dp_->finish_step();
      optimizer_->set_lr(schedule_->lr_at(step_));
      update();
    }
    if (!captured_ || !task_.capturable_after_step()) task_.after_step();
    ++step_;
    {
      NoGradGuard no_grad;
      Tensor sum = values[0];
      for (std::size_t i = 1; i < values.size(); ++i) sum = sum + values[i];
      pending_values_.push_back(sum);
    }
    window_syncs_ += host_sync_count() - syncs_before;
    ++window_synced_steps_;
    if (device_caps(loss_device).host_readable) flush_values();
    if (world_ == 1) return stop_here;
    Tensor stop = scalar(stop_here ? 1.0 : 0.0, {.dtype = DType::f64});
    group_.all_reduce(stop);
    return stop.item() > 0;
  }

  // What --profile's window saw: on the log, and as a metrics record.
  void report_profile(const StepProfile& profile) {
    if (!lead_) return;
    for (const std::string& line : profile.lines(kProfileLines)) progress_->line(line);
    append_metric(metrics_path_, history_.emplace_back(profile.record()));
    if (!s_.profile.trace_path.empty()) progress_->line(profile.write_trace());
  }

  // Says once that the step became a graph, or why it never will.
  void report_graph() {
    if (!captured_ || graph_reported_ == GraphReport::stopped) return;
    if (captured_->draws()) {
      graph_reported_ = GraphReport::stopped;
      progress_->line(
          "the step draws random numbers a replay could not draw again (on the host, as a "
          "random level count): it runs uncaptured, kernel by kernel");
    } else if (captured_->stopped()) {
      graph_reported_ = GraphReport::stopped;
      progress_->line(
          "the batches change shape from step to step (examples of different lengths), so "
          "each graph served one step: from step " +
          std::to_string(step_ + 1) +
          " the step runs uncaptured, kernel by kernel (packed or windowed data keeps one "
          "shape)");
    } else if (captured_->captures() > 0 && graph_reported_ == GraphReport::none) {
      graph_reported_ = GraphReport::captured;
      progress_->line(
          "step " + std::to_string(step_ + 1) + " captured as a graph of " +
          std::to_string(captured_->recorded_work()) +
          " kernels and copies; the steps after it replay it (--no-graph: not)" +
          (task_.capturable_after_step() && !captured_->after_in_graph()
               ? "; the state update after it draws on the host and runs after each replay"
               : ""));
    }
  }

  // Adds the steps' values not yet read to the log window: one read of the
  // device (and one all-reduce across ranks) for all of them. A non-finite
  // loss stops the run naming the first step that had one.
  void flush_values() {
    if (pending_values_.empty()) return;
    const auto n = static_cast<int64_t>(pending_values_.size());
    Tensor values = stack(pending_values_).to(Device::cpu());
    pending_values_.clear();
    if (world_ > 1) group_.all_reduce(values);
    const std::vector<double> v = values.to_vector<double>();
    const std::size_t width = names_.size() + 1;
    for (int64_t i = 0; i < n; ++i) {
      const double* row = v.data() + static_cast<std::size_t>(i) * width;
      const double loss = row[0] / world_;
      if (!std::isfinite(loss))
        throw std::runtime_error(s_.activity + " diverged: loss " + std::to_string(loss) +
                                 " at step " + std::to_string(step_ - n + 1 + i) +
                                 " (try a smaller --lr)");
      window_.loss += loss;
      for (std::size_t t = 0; t < names_.size(); ++t) window_.terms[t] += row[t + 1] / world_;
      ++window_.steps;
    }
    shown_loss_ = window_.loss / double(window_.steps);
  }

  int64_t epoch() const { return (step_ - 1) / per_epoch_ + 1; }  // 1-based, for people

  double elapsed_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  }

  // The "train" record and the progress line when a window ends (or the run
  // does), the bar's redraw otherwise.
  void log_step(bool stopping) {
    const bool window_ends = step_ % s_.log_every == 0;
    const bool log_now = window_ends || step_ == s_.total_steps;
    if (log_now || stopping || eval_due()) flush_values();
    const double n = double(window_.steps);
    if (log_now && lead_) {
      json record = {
          {"kind", "train"},         {"step", step_},
          {"epoch", epoch()},        {"loss", window_.loss / n},
          {"lr", lr_now()},          {s_.throughput_unit + "_per_s", progress_->throughput(step_)},
          {"elapsed_s", elapsed_s()}};
      std::vector<double> mean_terms;
      for (std::size_t i = 0; i < names_.size(); ++i)
        record[names_[i]] = mean_terms.emplace_back(window_.terms[i] / n);
      std::string shown;
      for (const WindowMetric& m : task_.window_metrics(mean_terms)) {
        record[m.name] = m.value;
        shown += (shown.empty() ? "" : "  ") + m.text;
      }
      progress_->set_window_text(shown);
      // Points inside the steps where the host waited for the device (0
      // on the CPU; the window's one read of the losses is not counted):
      // each one stalls a GPU's queue (engine/host_sync.h).
      if (window_synced_steps_ > 0)
        record["host_syncs_per_step"] = double(window_syncs_) / double(window_synced_steps_);
      append_metric(metrics_path_, history_.emplace_back(std::move(record)));
    }
    progress_->update(step_, epoch(), shown_loss_, log_now);
    if (window_ends) {
      window_ = LogWindow(names_.size(), step_ + 1);
      window_syncs_ = window_synced_steps_ = 0;
    }
  }

  bool sharded() const { return dp_ && dp_->sharded(); }

  // Whether the step may run as a graph: asked for, a task whose step can
  // be, on a device that records, with one rank (a collective's transport
  // is not captured), and not profiled (a replay calls no kernel table). Micro-batches are captured
  // together, in one graph.
  bool graphs_step() const {
    return s_.graph && s_.profile.steps == 0 && task_.capturable_step() && world_ == 1 &&
           !device_.is_cpu() && device_backend(device_.type).graph != nullptr;
  }

  // The lr of the last step taken (the first step's before any).
  double lr_now() const { return schedule_->lr_at(std::max<int64_t>(step_ - 1, 0)); }

  bool eval_due() const {
    if (step_ == s_.total_steps) return true;
    if (s_.eval_every == kEvalAtEnd) return false;
    return step_ % (s_.eval_every > 0 ? s_.eval_every : per_epoch_) == 0;
  }

  // Rank 0 alone (every rank holds the same model; an evaluation issues no
  // collective): the eval record, the checkpoint, the task's outputs. A
  // sharded model's forwards gather it: every rank evaluates, rank 0 writes.
  // The optimizer's whole state for a checkpoint: gathered from the ranks
  // that own it when it is sharded (a collective: every rank calls it).
  StateDict gathered_optimizer_state() {
    return opt_shards_ ? opt_shards_->gather_state(optimizer_->state_dict())
                       : optimizer_->state_dict();
  }

  json evaluate(const StateDict& optimizer_state) {
    const Evaluation ev = [&] {
      const MixedPrecision precision(s_.mixed_precision);
      return task_.evaluate();
    }();
    model_->train();
    if (!lead_) return ev.fields;
    json record = ev.fields;
    record["kind"] = "eval";
    record["step"] = step_;
    record["epoch"] = epoch();
    record["lr"] = lr_now();
    record["elapsed_s"] = elapsed_s();
    append_metric(metrics_path_, history_.emplace_back(record));
    save_and_write_outputs(true, optimizer_state);
    progress_->line("eval step " + std::to_string(step_) + " (epoch " + std::to_string(epoch()) +
                    "): " + ev.line);
    return ev.fields;
  }

  void save_and_write_outputs(bool evaluated, const StateDict& optimizer_state) {
    CheckpointInfo info;
    info.format = s_.checkpoint_format;
    info.config = s_.checkpoint_config;
    info.step = step_;
    info.epoch = step_ / per_epoch_;
    info.rng = task_.extra_state();
    info.rng["seed"] = s_.seed;
    info.log_window = window_.to_json(names_);
    info.results = task_.results();
    save_checkpoint(ckpt_path_, task_.state(), optimizer_state, info);
    task_.write_outputs(history_, evaluated);
  }

  LoopTask& task_;
  const LoopSettings& s_;
  dist::ProcessGroup& group_;
  const int rank_, world_;
  const bool lead_;  // the one rank that logs, evaluates and writes
  std::ostream& log_;
  std::shared_ptr<Module> model_;
  const std::vector<std::string> names_;
  std::unique_ptr<Adam> optimizer_;
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<dist::DataParallel> dp_;
  std::unique_ptr<dist::OptimizerShards> opt_shards_;  // with shard_optimizer_state
  const int64_t per_epoch_;
  const std::string ckpt_path_, metrics_path_;
  int64_t step_ = 0;
  std::vector<json> history_;
  LogWindow window_;
  std::vector<Tensor> pending_values_;  // per step: [loss, terms...] f64, not yet read
  double shown_loss_ = NAN;             // the progress line's: the window's mean so far
  int64_t window_syncs_ = 0, window_synced_steps_ = 0;  // host syncs in this window (not saved)
  BatchOrder order_;
  const Device device_;                     // the model's
  std::unique_ptr<CapturedStep> captured_;  // the step as a graph
  // What the log said of the graph: nothing yet, that it was captured, or
  // that the step runs uncaptured (the last word).
  enum class GraphReport { none, captured, stopped };
  GraphReport graph_reported_ = GraphReport::none;
  Progress* progress_ = nullptr;
  const std::chrono::steady_clock::time_point started_;
};

}  // namespace

std::ostream& lead_log(std::ostream& log, bool lead) {
  // Discards what is written to it.
  class NullBuffer : public std::streambuf {
   protected:
    int overflow(int c) override { return c; }
  };
  static NullBuffer null_buffer;
  static std::ostream null_log(&null_buffer);
  return lead ? log : null_log;
}

StateDict LoopTask::state() { return model()->state_dict(); }

StateDict trainable_state(Module& model) {
  StateDict out;
  for (const auto& [name, p] : model.named_parameters())
    if (p.requires_grad()) out.emplace_back(name, p.detach());
  return out;
}

void load_trainable_state(Module& model, const StateDict& state, const std::string& hint) {
  NoGradGuard no_grad;
  for (const auto& [name, p] : model.named_parameters()) {
    if (!p.requires_grad()) continue;
    const Tensor* t = find_tensor(state, name);
    if (!t || t->shape() != p.shape())
      throw std::runtime_error("the fine-tuning checkpoint has no adapter '" + name + "' of " +
                               shape_str(p.shape()) + " (" + hint + ")");
    copy_(p, t->to(p.dtype()).to(p.device()));
  }
}

json random_stream_states(Module& model) {
  json out = json::object();
  for (const auto& [name, m] : model.named_modules()) {
    const std::vector<Generator*> streams = m->own_random_streams();
    if (streams.size() > 1)
      throw std::logic_error("random_stream_states: " + name + " has several streams");
    if (streams.empty()) continue;
    const GeneratorState g = streams[0]->state();
    out[name] = {g.seed, g.key, g.offset.lo, g.offset.hi};
  }
  return out;
}

void load_random_stream_states(Module& model, const json& states) {
  for (const auto& [name, m] : model.named_modules()) {
    const std::vector<Generator*> streams = m->own_random_streams();
    if (streams.empty()) continue;
    if (!states.contains(name))
      throw std::runtime_error("the fine-tuning checkpoint has no dropout stream of " + name);
    const json& g = states.at(name);
    streams[0]->set_state(
        {g[0].get<uint64_t>(), g[1].get<uint64_t>(), {g[2].get<uint64_t>(), g[3].get<uint64_t>()}});
  }
}

void LoopTask::load_state(const StateDict& state) { model()->load_state_dict(state); }

LoopResult run_loop(LoopTask& task, const LoopSettings& settings, dist::ProcessGroup& group,
                    std::ostream& log) {
  if (settings.examples <= 0)
    throw std::invalid_argument("--limit-train 0 leaves nothing to train on");
  return Loop(task, settings, group, log).run();
}

}  // namespace quanta::train
