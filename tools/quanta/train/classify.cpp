#include "train/classify.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <stdexcept>

#include "data/fashion_mnist.h"
#include "dist/process_group.h"
#include "engine/cpu/parallel.h"
#include "engine/ops/index.h"
#include "engine/ops/loss.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/limits.h"
#include "train/outputs.h"
#include "train/run_device.h"

namespace quanta::train {
namespace {

using nlohmann::json;

// An integer in [min, max] (limits.h).
int64_t int_at(const json& j, const char* key, int64_t min, int64_t max) {
  const json& v = j.at(key);
  // JSON's non-negative integers are held unsigned.
  const bool ok = v.is_number_unsigned()
                      ? v.get<uint64_t>() >= uint64_t(std::max<int64_t>(min, 0)) &&
                            v.get<uint64_t>() <= uint64_t(max)
                      : v.is_number_integer() && v.get<int64_t>() >= min && v.get<int64_t>() <= max;
  if (!ok)
    throw std::invalid_argument("[classify] '" + std::string(key) + "' must be an integer from " +
                                std::to_string(min) + " to " + std::to_string(max) + ", got " +
                                v.dump());
  return v.get<int64_t>();
}

}  // namespace

ClassifyConfig classify_config(const json& flags) {
  ClassifyConfig c;
  c.data = data::kFashionMnistDir;
  return classify_config(flags, classify_config_json(c));
}

ClassifyConfig classify_config(const json& flags, const json& base) {
  ClassifyConfig c;
  int64_t epochs = 0;
  for (const auto& [key, v] : flags.items()) {
    if (key == "model" || key == "quantizer")
      throw std::invalid_argument(
          "--task classify trains a fixed MLP (784-256-128-10) and takes "
          "no " +
          std::string(key == "model" ? "--hidden / --dim" : "quantizer") + " options");
    if (key == "nproc" && v != 1)
      throw std::invalid_argument("--task classify trains on one process; --nproc " + v.dump() +
                                  " is for the VQ-VAE and quanta finetune");
    if (key == "eval_every")
      throw std::invalid_argument("--task classify evaluates once, at the end; drop --eval-every");
  }
  json j = base;
  for (const char* key : {"data", "limit_train", "limit_test", "steps", "batch_size", "lr", "seed",
                          "log_every", "threads", "device"})
    if (flags.contains(key)) j[key] = flags[key];
  if (flags.contains("epochs")) epochs = int_at(flags, "epochs", 1, kMaxEpochs);
  c = classify_config_from_json(j);
  if (c.limit_test == 0) throw std::invalid_argument("--limit-test must not be 0");
  if (epochs > 0) {
    // Resolved once the training set's size is known (run_classify).
    c.steps = -epochs;
  }
  return c;
}

json classify_config_json(const ClassifyConfig& c) {
  return json{{"task", "classify"},
              {"data", c.data},
              {"limit_train", c.limit_train},
              {"limit_test", c.limit_test},
              {"steps", c.steps},
              {"batch_size", c.batch_size},
              {"lr", c.lr},
              {"seed", c.seed},
              {"log_every", c.log_every},
              {"threads", c.threads},
              {"device", c.device},
              {"model", {{"hidden1", c.model.hidden1}, {"hidden2", c.model.hidden2}}}};
}

ClassifyConfig classify_config_from_json(const json& j) {
  if (!j.is_object() || j.value("task", "") != "classify")
    throw std::invalid_argument("[classify] not a classifier config (no \"task\": \"classify\")");
  ClassifyConfig c;
  try {
    c.data = j.at("data").get<std::string>();
    c.limit_train = int_at(j, "limit_train", -1, kMaxCount);
    c.limit_test = int_at(j, "limit_test", -1, kMaxCount);
    c.steps = int_at(j, "steps", 1, kMaxSteps);
    c.batch_size = int_at(j, "batch_size", 1, kMaxBatchSize);
    c.lr = j.at("lr").get<double>();
    c.seed = j.at("seed").get<uint64_t>();
    c.log_every = int_at(j, "log_every", 1, kMaxCount);
    c.threads = int_at(j, "threads", 0, kMaxThreads);
    c.device = j.value("device", std::string("cpu"));
    c.model.hidden1 = int_at(j.at("model"), "hidden1", 1, kMaxChannels);
    c.model.hidden2 = int_at(j.at("model"), "hidden2", 1, kMaxChannels);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("[classify] bad config: ") + e.what());
  }
  if (!(c.lr > 0) || !std::isfinite(c.lr))
    throw std::invalid_argument("[classify] 'lr' must be > 0, got " + std::to_string(c.lr));
  return c;
}

ClassifierTask::ClassifierTask(std::shared_ptr<Sequential> model, const data::ImageDataset& train,
                               const data::ImageDataset& test, Device device, Describe describe)
    : model_(std::move(model)),
      train_(train),
      test_(test),
      device_(device),
      describe_(std::move(describe)) {
  // Initialised on the CPU (the same draws on every device), then moved.
  if (!device_.is_cpu()) model_->to(device_);
}

StepLoss ClassifierTask::step(const BatchShare& share) {
  // Sum over this rank's rows / global rows, times W (loop.h's StepLoss):
  // the mean over the global batch once the ranks' parts are averaged. The
  // datasets stay on the host; each batch travels to the model's device.
  const Tensor images = index_select(train_.images, 0, share.rows).to(device_);
  const Tensor labels = index_select(train_.labels, 0, share.rows).to(device_);
  const Tensor sum_loss = cross_entropy(model_->forward(images), labels, Reduction::sum);
  return {sum_loss * (double(share.world) / double(share.global_rows)), {}};
}

Evaluation ClassifierTask::evaluate() {
  const double acc = accuracy(*model_, test_.images, test_.labels);
  results_ = {{"test_accuracy", acc}, {"test_samples", test_.size()}};
  char text[32];
  std::snprintf(text, sizeof text, "%.2f%%", 100 * acc);
  return {results_, std::string("test accuracy ") + text + " (" + std::to_string(test_.size()) +
                        " test images)"};
}

double ClassifierTask::test_accuracy() const {
  return results_.empty() ? NAN : results_["test_accuracy"].get<double>();
}

ClassifyResult run_classify(const ClassifyConfig& config, const ClassifyJob& job,
                            std::ostream& log) {
  const std::string& out_dir = job.out_dir;
  ClassifyConfig cfg = config;
  const Device device = run_device(cfg.device);
  if (cfg.threads > 0) set_num_threads(static_cast<int>(cfg.threads));
  const data::ImageDataset train_set =
      data::load_fashion_mnist(cfg.data, data::Split::train, cfg.limit_train);
  const data::ImageDataset test_set =
      data::load_fashion_mnist(cfg.data, data::Split::test, cfg.limit_test);
  const int64_t n = train_set.size();
  const int64_t per_epoch = (n + cfg.batch_size - 1) / cfg.batch_size;
  if (cfg.steps < 0) cfg.steps = -cfg.steps * per_epoch;  // --epochs

  Generator gen = Generator::named(cfg.seed, "model");
  ClassifierTask task(make_classifier(cfg.model, gen), train_set, test_set, device,
                      [&](std::ostream& os, int64_t start, int64_t total) {
                        os << "training a classifier (MLP 784-" << cfg.model.hidden1 << "-"
                           << cfg.model.hidden2 << "-10) on " << n << " images (" << test_set.size()
                           << " test) from " << cfg.data << "\n"
                           << (start > 0 ? "resuming at step " + std::to_string(start) + " of "
                                         : std::string("steps: "))
                           << total << " (" << per_epoch << " per epoch, batch " << cfg.batch_size
                           << ", lr " << cfg.lr << ", seed " << cfg.seed << ", " << num_threads()
                           << " threads); writing to " << out_dir << "\n"
                           << std::flush;
                      });
  LoopSettings s;
  s.out_dir = out_dir;
  s.resume = job.resume;
  s.progress_bar = job.progress_bar;
  s.examples = task.examples();
  s.batch_size = cfg.batch_size;
  s.total_steps = cfg.steps;
  s.seed = cfg.seed;
  s.log_every = cfg.log_every;
  s.eval_every = kEvalAtEnd;
  s.lr = cfg.lr;
  s.profile = job.profile;
  s.checkpoint_format = kClassifierFormat;
  s.checkpoint_config = classify_config_json(cfg);
  s.header = {
      {"quanta_version", job.version}, {"config", s.checkpoint_config}, {"device", device.str()}};
  const std::shared_ptr<dist::ProcessGroup> group = dist::ProcessGroup::single();
  const LoopResult lr = run_loop(task, s, *group, log);

  ClassifyResult r;
  r.steps = lr.step;
  r.interrupted = lr.interrupted;
  r.test_accuracy = task.test_accuracy();
  r.test_samples = test_set.size();
  r.checkpoint = out_file(out_dir, kCheckpointFile);
  return r;
}

void run_classify_command(const json& flags, const ClassifyJob& job, bool print_config,
                          std::ostream& log) {
  json base = classify_config_json(classify_config(json::object()));
  if (job.resume) {
    const Checkpoint ck = load_checkpoint(
        (std::filesystem::path(job.out_dir) / kCheckpointFile).string(), kClassifierFormat);
    base = ck.info.config;
  }
  const ClassifyConfig cfg = classify_config(flags, base);
  if (job.resume) {
    json now = classify_config_json(cfg);
    const std::string diff = resume_conflict(base, now);
    if (!diff.empty())
      throw std::invalid_argument("--resume cannot change the run it continues (" + diff + ")");
  }
  if (print_config) {
    json j = classify_config_json(cfg);
    if (cfg.steps < 0) j["steps"] = nullptr, j["epochs"] = -cfg.steps;
    log << j.dump(2) << "\n";
    return;
  }
  const ClassifyResult r = run_classify(cfg, job, log);
  if (r.interrupted) return;
  char acc[32];
  std::snprintf(acc, sizeof acc, "%.2f%%", 100 * r.test_accuracy);
  log << "done: " << r.steps << " steps; test accuracy " << acc << " (" << r.test_samples
      << " test images)\n"
      << "checkpoint: " << r.checkpoint << "\n";
}

}  // namespace quanta::train
