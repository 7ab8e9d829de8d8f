#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <ostream>
#include <stdexcept>
#include <streambuf>

#include "data/fashion_mnist.h"
#include "dist/data_parallel.h"
#include "dist/env.h"
#include "engine/cpu/parallel.h"
#include "engine/device.h"
#include "engine/factory.h"
#include "engine/ops/index.h"
#include "engine/ops/loss.h"
#include "engine/ops/reduce.h"
#include "engine/optim/optimizer.h"
#include "engine/random/sampling.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/outputs.h"
#include "train/progress.h"
#include "train/vqvae.h"

namespace quanta::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The one piece of state a signal handler may touch.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installs the SIGINT / SIGTERM handlers for the life of a run. SA_RESETHAND:
// a second Ctrl-C gets the default action, so a stuck run can still be killed.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int caught() const { return g_stop_signal; }

 private:
  struct sigaction old_int_ {
  }, old_term_{};
};

// The device the model and the batches live on; a clear error when this
// build or this machine cannot give it.
Device where_to_run(const TrainConfig& c) {
  Device d;
  try {
    d = Device::parse(c.device);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("--device must be cpu, cuda or cuda:N, got '" + c.device + "'");
  }
  if (d.is_cpu()) return d;
  if (!cuda_built())
    throw std::invalid_argument("--device " + c.device + ": this quanta was built without CUDA");
  const int visible = cuda_device_count();
  if (d.index >= visible)
    throw std::invalid_argument("--device " + c.device + ": " + std::to_string(visible) +
                                " CUDA devices are visible");
  return d;
}

// The ranks of this run: the launcher's (torchrun / quanta launch / srun /
// mpirun) when one started us, else a world of one. --nproc, when more than
// 1, must agree with the launcher's world size.
std::shared_ptr<dist::ProcessGroup> make_group(const TrainConfig& c) {
  const dist::LaunchInfo info = dist::launch_info_from_env();
  if (info.source == "none") {
    if (c.nproc != 1)
      throw std::invalid_argument("--nproc " + std::to_string(c.nproc) +
                                  " needs a launcher: run it from the quanta command (which "
                                  "starts the ranks through quanta launch) or under torchrun, "
                                  "srun or mpirun");
    return dist::ProcessGroup::single();
  }
  if (c.nproc != 1 && c.nproc != info.world_size)
    throw std::invalid_argument("--nproc " + std::to_string(c.nproc) + " but the launcher (" +
                                info.source + ") started " + std::to_string(info.world_size) +
                                " ranks");
  return dist::init(info);
}

// Discards what is written to it (the log of ranks other than 0).
class NullBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
};

std::string out_path(const std::string& dir, const char* name) {
  return (fs::path(dir) / name).string();
}

// The sums behind the next "train" record of metrics.jsonl. A window runs
// from one multiple of --log-every to the next, whatever happens between
// (an evaluation, an interruption, the end of a run that a resume extends):
// the checkpoint keeps the partial sums, so the first record after --resume
// averages the steps an uninterrupted run's record would.
struct LogWindow {
  int64_t first_step = 1;  // the first step it covers
  double loss = 0, recon = 0, aux = 0;
  int64_t steps = 0;

  json to_json() const {
    if (steps == 0) return json::object();
    return {{"first_step", first_step},
            {"loss_sum", loss},
            {"recon_sum", recon},
            {"aux_sum", aux},
            {"steps", steps}};
  }
  // The window a checkpoint at `step` left, when it belongs to the window
  // this run's --log-every opens at the last multiple before `step` (a run
  // that changed --log-every starts a fresh one).
  static LogWindow restore(const json& j, int64_t step, int64_t log_every) {
    LogWindow w;
    w.first_step = step / log_every * log_every + 1;
    if (j.empty() || j.value("first_step", int64_t{0}) != w.first_step) {
      w.first_step = step + 1;
      return w;
    }
    w.loss = j.at("loss_sum").get<double>();
    w.recon = j.at("recon_sum").get<double>();
    w.aux = j.at("aux_sum").get<double>();
    w.steps = j.at("steps").get<int64_t>();
    return w;
  }
};

}  // namespace

Tensor rank_share(const Tensor& batch, int rank, int world) {
  const int64_t b = batch.size(0);
  const int64_t lo = b * rank / world, hi = b * (rank + 1) / world;
  return batch.narrow(0, lo, hi - lo);
}

namespace {

Tensor epoch_permutation(uint64_t seed, int64_t epoch, int64_t n) {
  Generator gen = Generator::named(seed, "data-order").fork("epoch-" + std::to_string(epoch));
  return randperm(n, gen);
}

}  // namespace

Tensor batch_indices(uint64_t seed, int64_t step, int64_t n, int64_t batch_size) {
  return BatchOrder(seed, n, batch_size).batch(step);
}

BatchOrder::BatchOrder(uint64_t seed, int64_t n, int64_t batch_size)
    : seed_(seed), n_(n), batch_size_(batch_size) {}

Tensor BatchOrder::batch(int64_t step) {
  const int64_t per_epoch = (n_ + batch_size_ - 1) / batch_size_;
  const int64_t epoch = step / per_epoch, k = step % per_epoch;
  if (epoch != epoch_) {
    perm_ = epoch_permutation(seed_, epoch, n_);
    epoch_ = epoch;
  }
  return perm_.narrow(0, k * batch_size_, std::min(batch_size_, n_ - k * batch_size_));
}

TrainResult run_training(const TrainJob& job, std::ostream& out_log) {
  const TrainConfig cfg = config_from_json(job.config);
  const Device device = where_to_run(cfg);
  const std::shared_ptr<dist::ProcessGroup> group = make_group(cfg);
  const int rank = group->rank(), world = group->size();
  const bool lead = rank == 0;  // the one rank that logs, evaluates and writes
  NullBuffer null_buffer;
  std::ostream null_log(&null_buffer);
  std::ostream& log = lead ? out_log : null_log;
  if (cfg.limit_test == 0) throw std::invalid_argument("--limit-test must not be 0");
  if (cfg.threads > 0) set_num_threads(static_cast<int>(cfg.threads));

  const data::ImageDataset train_set =
      data::load_fashion_mnist(cfg.data, data::Split::train, cfg.limit_train);
  const data::ImageDataset test_set =
      data::load_fashion_mnist(cfg.data, data::Split::test, cfg.limit_test);
  const int64_t n = train_set.size();
  if (n == 0) throw std::invalid_argument("--limit-train 0 leaves nothing to train on");

  Generator model_gen = Generator::named(cfg.seed, "model");
  auto model_ptr = std::make_shared<VqVae>(
      cfg.model, make_quantizer(cfg.quantizer, cfg.model.dim, cfg.seed), model_gen);
  VqVae& model = *model_ptr;
  // Initialised on the CPU (the same draws on every device), then moved.
  if (!device.is_cpu()) model.to(device);
  model.quantizer().set_group(*group);
  std::vector<Tensor> trainable;
  for (const Tensor& p : model.parameters())
    if (p.requires_grad()) trainable.push_back(p);
  Adam optimizer(trainable, {.lr = cfg.lr});
  // Gradients averaged over the ranks; the quantizer's state is reconciled
  // by its own after_step() (QuantizerSync), so buffers are not broadcast.
  std::unique_ptr<dist::DataParallel> dp;
  if (world > 1)
    dp = std::make_unique<dist::DataParallel>(
        model_ptr, *group, dist::DataParallelOptions{.broadcast_buffers = false});

  const int64_t per_epoch = (n + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total = cfg.steps > 0 ? cfg.steps : cfg.epochs * per_epoch;
  const std::string ckpt_path = out_path(job.out_dir, kCheckpointFile);
  const std::string metrics_path = out_path(job.out_dir, kMetricsFile);
  if (lead) fs::create_directories(job.out_dir);

  const auto started = std::chrono::steady_clock::now();
  auto elapsed_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  int64_t step = 0;
  std::vector<json> history;
  LogWindow window;
  if (job.resume) {
    Checkpoint ck = load_checkpoint(ckpt_path);
    model.load_state_dict(ck.model);
    optimizer.load_state_dict(ck.optimizer);
    model.quantizer().load_extra_state(ck.info.rng.value("quantizer", json::object()));
    step = ck.info.step;
    window = LogWindow::restore(ck.info.log_window, step, cfg.log_every);
    // Records past the checkpoint belong to steps that will run again.
    for (json& r : read_metrics(metrics_path))
      if (r.value("step", int64_t{0}) <= step) history.push_back(std::move(r));
    group->barrier();  // every rank has read the files before rank 0 rewrites them
    if (step >= total)
      throw std::invalid_argument("--resume: the checkpoint is at step " + std::to_string(step) +
                                  ", the run asks for " + std::to_string(total) +
                                  " steps; raise --steps or --epochs");
  }
  // Each start of the run (the first and every --resume) opens with a header:
  // what ran, where and how, so a metrics file explains itself.
  if (lead) {
    history.push_back(json{{"kind", "header"},
                           {"quanta_version", job.version},
                           {"step", step},
                           {"resumed", job.resume},
                           {"config", resolved_config(job.config)},
                           {"threads", num_threads()},
                           {"device", device.str()},
                           {"world_size", world}});
    write_metrics(metrics_path, history);
  }

  log << "training a VQ-VAE (quantizer " << cfg.quantizer["type"].get<std::string>() << ", hidden "
      << cfg.model.hidden << ", dim " << cfg.model.dim << ") on " << n << " images ("
      << test_set.size() << " test) from " << cfg.data << "\n"
      << (job.resume ? "resuming at step " + std::to_string(step) + " of " : std::string("steps: "))
      << total << " (" << per_epoch << " per epoch, batch " << cfg.batch_size << ", lr " << cfg.lr
      << ", seed " << cfg.seed << ", " << num_threads() << " threads"
      << (world > 1 ? " x " + std::to_string(world) + " ranks" : std::string()) << "); writing to "
      << job.out_dir << "\n"
      << std::flush;

  TrainResult result;
  result.total_steps = total;
  result.rank = rank;
  auto save = [&] {
    CheckpointInfo info;
    info.config = config_to_json(cfg);
    info.step = step;
    info.epoch = step / per_epoch;
    info.rng = {{"seed", cfg.seed}, {"quantizer", model.quantizer().extra_state()}};
    info.log_window = window.to_json();
    save_checkpoint(ckpt_path, model, &optimizer, info);
  };
  const std::string qtype = cfg.quantizer["type"].get<std::string>();

  Progress progress(log, job.progress_bar, step, total, cfg.batch_size);
  BatchOrder order(cfg.seed, n, cfg.batch_size);
  StopSignals signals;
  model.train();
  while (step < total) {
    // The global batch of this step; this rank takes its contiguous share.
    const Tensor batch = order.batch(step);
    const int64_t b = batch.numel();
    const Tensor share = rank_share(batch, rank, world);
    // The dataset stays on the host; each batch travels to the model's device.
    const Tensor x = index_select(train_set.images, 0, share).to(device);
    VqVaeOutput out = model.run(x);
    // Each rank's share of the whole-batch loss, summed over ranks = world x
    // that loss (DataParallel averages, so the gradient is the whole batch's,
    // whatever the split): local sums over the global count, and the
    // quantizer's loss weighted by its token share unless it is global.
    const double pixels = double(x.numel() / std::max<int64_t>(x.size(0), 1));
    const Tensor recon =
        sum(square(out.reconstruction - x)) * (double(world) / (double(b) * pixels));
    const double aux_weight = model.quantizer().loss_is_global()
                                  ? 1.0
                                  : double(world) * double(share.numel()) / double(b);
    const Tensor aux = sum(out.quantized.loss) * aux_weight;
    const Tensor loss = recon + aux;
    optimizer.zero_grad();
    loss.backward();
    if (dp) dp->finish_step();
    optimizer.step();
    model.quantizer().after_step();
    ++step;
    // One fixed collective per step: the logged losses and whether any
    // rank was asked to stop (so every rank stops after the same step).
    Tensor shared = from_vector<double>(
        {loss.item(), recon.item(), aux.item(), signals.caught() ? 1.0 : 0.0}, {4});
    group->all_reduce(shared);
    const std::vector<double> totals = shared.to_vector<double>();
    const bool stop = totals[3] > 0;

    const double l = totals[0] / world;
    if (!std::isfinite(l))
      throw std::runtime_error("training diverged: loss " + std::to_string(l) + " at step " +
                               std::to_string(step) + " (try a smaller --lr)");
    window.loss += l, window.recon += totals[1] / world, window.aux += totals[2] / world;
    ++window.steps;
    const int64_t epoch = (step - 1) / per_epoch + 1;  // 1-based, for people
    const bool window_ends = step % cfg.log_every == 0;
    const bool log_now = window_ends || step == total;
    const double n_window = double(window.steps);
    if (log_now && lead) {
      append_metric(metrics_path,
                    history.emplace_back(json{{"kind", "train"},
                                              {"step", step},
                                              {"epoch", epoch},
                                              {"loss", window.loss / n_window},
                                              {"recon_mse", window.recon / n_window},
                                              {"aux_loss", window.aux / n_window},
                                              {"lr", cfg.lr},
                                              {"img_per_s", progress.throughput(step)},
                                              {"elapsed_s", elapsed_s()}}));
    }
    progress.update(step, epoch, window.loss / n_window, log_now);
    if (window_ends) {
      window = LogWindow();
      window.first_step = step + 1;
    }

    if (stop) {
      if (lead) {
        save();
        write_loss_plot(out_path(job.out_dir, kLossFile), history);
      }
      const int sig = signals.caught();
      progress.line(std::string("interrupted by ") +
                    (sig == SIGINT    ? "SIGINT"
                     : sig == SIGTERM ? "SIGTERM"
                                      : "another rank") +
                    " after step " + std::to_string(step) + "; checkpoint written to " + ckpt_path +
                    " (continue with --resume --out " + job.out_dir + ")");
      result.interrupted = true;
      break;
    }
    const bool eval_now =
        step == total || (cfg.eval_every > 0 ? step % cfg.eval_every == 0 : step % per_epoch == 0);
    // Evaluation and outputs on rank 0 alone (every rank holds the same
    // model); eval forwards issue no collective.
    if (!eval_now || !lead) continue;
    const EvalResult ev = evaluate(model, test_set.images, 256);
    result.last_eval = ev;
    append_metric(metrics_path, history.emplace_back(json{{"kind", "eval"},
                                                          {"step", step},
                                                          {"epoch", epoch},
                                                          {"test_mse", ev.mse},
                                                          {"codebook_usage", ev.usage},
                                                          {"perplexity", ev.perplexity},
                                                          {"test_samples", ev.samples},
                                                          {"lr", cfg.lr},
                                                          {"elapsed_s", elapsed_s()}}));
    save();
    write_loss_plot(out_path(job.out_dir, kLossFile), history);
    write_usage_plot(out_path(job.out_dir, kUsageFile), ev, qtype);
    write_reconstructions(out_path(job.out_dir, kReconstructionsFile), model, test_set.images,
                          "quantizer " + qtype + ", step " + std::to_string(step) + ", test mse " +
                              fmt_metric(ev.mse, 5));
    progress.line("eval step " + std::to_string(step) + " (epoch " + std::to_string(epoch) +
                  "): test mse " + fmt_metric(ev.mse, 5) + "  codebook usage " +
                  (std::isfinite(ev.usage) ? fmt_metric(100 * ev.usage, 1) + "%" : "n/a") +
                  "  perplexity " + fmt_metric(ev.perplexity, 1));
  }
  progress.finish();
  result.step = step;
  return result;
}

}  // namespace quanta::train
