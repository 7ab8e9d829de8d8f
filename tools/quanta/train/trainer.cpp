#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <ostream>
#include <stdexcept>

#include "data/fashion_mnist.h"
#include "dist/env.h"
#include "engine/cpu/parallel.h"
#include "engine/device.h"
#include "engine/factory.h"
#include "engine/ops/index.h"
#include "engine/ops/loss.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/loop.h"
#include "train/outputs.h"
#include "train/run_device.h"
#include "train/vqvae.h"

namespace quanta::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

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

// The VQ-VAE as a task of the training loop.
class VqVaeTask : public LoopTask {
 public:
  VqVaeTask(const TrainConfig& cfg, const std::string& out_dir, Device device,
            dist::ProcessGroup& group)
      : cfg_(cfg),
        out_dir_(out_dir),
        device_(device),
        qtype_(cfg.quantizer["type"].get<std::string>()),
        // The model before the data: a mistake in its settings is named
        // without reading (or needing) the dataset.
        model_(make_model(cfg)),
        train_set_(data::load_fashion_mnist(cfg.data, data::Split::train, cfg.limit_train)),
        test_set_(data::load_fashion_mnist(cfg.data, data::Split::test, cfg.limit_test)),
        world_(group.size()) {
    // Initialised on the CPU (the same draws on every device), then moved.
    if (!device.is_cpu()) model_->to(device);
    model_->quantizer().set_group(group);
  }

  int64_t examples() const { return train_set_.size(); }
  void set_activation_layout(ActivationLayout layout) { model_->set_activation_layout(layout); }
  const EvalResult& last_eval() const { return last_eval_; }

  std::shared_ptr<Module> model() override { return model_; }

  void describe(std::ostream& log, int64_t start_step, int64_t total) const override {
    const int64_t n = train_set_.size(), per_epoch = (n + cfg_.batch_size - 1) / cfg_.batch_size;
    log << "training a VQ-VAE (quantizer " << qtype_ << ", hidden " << cfg_.model.hidden << ", dim "
        << cfg_.model.dim << ") on " << n << " images (" << test_set_.size() << " test) from "
        << cfg_.data << "\n"
        << (start_step > 0 ? "resuming at step " + std::to_string(start_step) + " of "
                           : std::string("steps: "))
        << total << " (" << per_epoch << " per epoch, batch " << cfg_.batch_size << ", lr "
        << cfg_.lr << ", seed " << cfg_.seed << ", " << num_threads() << " threads"
        << (world_ > 1 ? " x " + std::to_string(world_) + " ranks" : std::string())
        << "); writing to " << out_dir_ << "\n"
        << std::flush;
  }

  std::vector<std::string> term_names() const override {
    if (cfg_.recon_loss == "l1") return {"recon_mse", "aux_loss", "recon_l1"};
    return {"recon_mse", "aux_loss"};
  }

  // The dataset stays on the host; each batch travels to the model's device.
  std::vector<Tensor> step_inputs(const BatchShare& share) override {
    return {index_select(train_set_.images, 0, share.rows)};
  }
  bool capturable_step() const override { return true; }

  StepLoss step(const BatchShare& share) override {
    const Tensor& x = share.inputs.at(0);
    VqVaeOutput out = model_->run(x);
    // Local sums over the global count, and the quantizer's loss weighted by
    // its token share unless it is global (loop.h's StepLoss).
    const double b = double(share.global_rows), w = double(share.world);
    const double pixels = double(x.numel() / std::max<int64_t>(x.size(0), 1));
    const double scale = w / (b * pixels), units = model_->image_scale();
    const Tensor diff = out.reconstruction - x;
    const Tensor recon = sum(square(diff)) * scale;  // on [0, 1]: what metrics report
    const double aux_weight =
        model_->quantizer().loss_is_global() ? 1.0 : w * double(share.rows.numel()) / b;
    // One loss (every quantizer's) is taken as it is and a weight of 1 not
    // applied: the same values, three launches fewer a step with backward.
    const Tensor& loss = out.quantized.loss;
    Tensor aux = loss.numel() == 1 ? reshape(loss, {}) : sum(loss);
    if (aux_weight != 1.0) aux = aux * aux_weight;
    if (cfg_.recon_loss == "l1") {
      const Tensor l1 = sum(abs(diff)) * (scale * units);
      return {l1 + aux, {recon, aux, l1}};
    }
    // In [0, 1] units (the conv arch) the loss is the reported mse itself.
    return {(units == 1.0 ? recon : recon * (units * units)) + aux, {recon, aux}};
  }

  void after_step() override { model_->quantizer().after_step(); }
  // One rank's reconciliation is device work and host counters that replay.
  bool capturable_after_step() const override { return true; }

  Evaluation evaluate() override {
    last_eval_ = train::evaluate(*model_, test_set_.images, 256);
    const EvalResult& ev = last_eval_;
    Evaluation e{{{"test_mse", ev.mse},
                  {"psnr", ev.psnr},
                  {"codebook_usage", ev.usage},
                  {"perplexity", ev.perplexity},
                  {"test_samples", ev.samples}},
                 "test mse " + fmt_metric(ev.mse, 5) + "  psnr " + fmt_metric(ev.psnr, 2) +
                     " dB  codebook usage " + fmt_percent(ev.usage) + "  perplexity " +
                     fmt_metric(ev.perplexity, 1)};
    if (!ev.per_codebook.empty()) {
      e.fields.update(per_codebook_fields(ev));
      std::string usage_text, perplexity_text;
      for (const CodebookFigures& c : ev.per_codebook) {
        usage_text += " " + fmt_percent(c.usage);
        perplexity_text += " " + fmt_metric(c.perplexity, 1);
      }
      e.line += "\n  per codebook (" + ev.per_codebook.front().name + " first): usage" +
                usage_text + ", perplexity" + perplexity_text;
    }
    return e;
  }

  std::vector<WindowMetric> window_metrics(const std::vector<double>& mean_terms) const override {
    const double psnr = psnr_db(mean_terms.at(0));  // recon_mse: term_names()[0]
    return {{"psnr", psnr, "psnr " + fmt_metric(psnr, 2) + " dB"}};
  }

  void write_outputs(const std::vector<json>& history, bool evaluated) override {
    write_loss_plot(out_file(out_dir_, kLossFile), history);
    if (!evaluated) return;
    const int64_t step = history.empty() ? 0 : history.back().value("step", int64_t{0});
    write_usage_plot(out_file(out_dir_, kUsageFile), last_eval_, qtype_);
    write_reconstructions(out_file(out_dir_, kReconstructionsFile), *model_, test_set_.images,
                          "quantizer " + qtype_ + ", step " + std::to_string(step) + ", test mse " +
                              fmt_metric(last_eval_.mse, 5));
  }

  json extra_state() const override { return {{"quantizer", model_->quantizer().extra_state()}}; }
  void load_extra_state(const json& rng) override {
    model_->quantizer().load_extra_state(rng.value("quantizer", json::object()));
  }

 private:
  static std::shared_ptr<VqVae> make_model(const TrainConfig& cfg) {
    Generator model_gen = Generator::named(cfg.seed, "model");
    return std::make_shared<VqVae>(
        cfg.model, make_quantizer(cfg.quantizer, cfg.model.dim, cfg.seed), model_gen);
  }

  const TrainConfig& cfg_;
  const std::string out_dir_;
  const Device device_;
  const std::string qtype_;
  std::shared_ptr<VqVae> model_;
  const data::ImageDataset train_set_, test_set_;
  const int world_;
  EvalResult last_eval_;
};

}  // namespace

TrainResult run_training(const TrainJob& job, std::ostream& log) {
  const TrainConfig cfg = config_from_json(job.config);
  const Device device = run_device(cfg.device);
  const std::shared_ptr<dist::ProcessGroup> group = make_group(cfg);
  if (cfg.limit_test == 0) throw std::invalid_argument("--limit-test must not be 0");
  if (cfg.threads > 0) set_num_threads(static_cast<int>(cfg.threads));

  VqVaeTask task(cfg, job.out_dir, device, *group);
  task.set_activation_layout(job.layout);
  LoopSettings s;
  s.out_dir = job.out_dir;
  s.resume = job.resume;
  s.progress_bar = job.progress_bar;
  s.examples = task.examples();
  s.batch_size = cfg.batch_size;
  const int64_t per_epoch = (s.examples + cfg.batch_size - 1) / cfg.batch_size;
  s.total_steps = cfg.steps > 0 ? cfg.steps : cfg.epochs * per_epoch;
  s.seed = cfg.seed;
  s.log_every = cfg.log_every;
  s.eval_every = cfg.eval_every;
  s.lr = cfg.lr;
  s.optimizer.schedule = cfg.lr_schedule;
  s.optimizer.warmup_steps = cfg.warmup_steps;
  s.optimizer.adamw = cfg.weight_decay > 0;
  s.optimizer.weight_decay = cfg.weight_decay;
  s.mixed_precision = cfg.precision == "bf16";
  s.graph = job.graph;
  s.profile = job.profile;
  s.checkpoint_format = kCheckpointFormat;
  s.checkpoint_config = config_to_json(cfg);
  s.header = {{"quanta_version", job.version},
              {"config", resolved_config(job.config)},
              {"device", device.str()}};
  // Gradients averaged over the ranks; the quantizer's state is reconciled
  // by its own after_step() (QuantizerSync), so buffers are not broadcast.
  s.data_parallel.broadcast_buffers = false;

  const LoopResult r = run_loop(task, s, *group, log);
  TrainResult result;
  result.step = r.step;
  result.total_steps = s.total_steps;
  result.interrupted = r.interrupted;
  result.rank = group->rank();
  if (!r.last_eval.empty()) result.last_eval = task.last_eval();
  return result;
}

}  // namespace quanta::train
