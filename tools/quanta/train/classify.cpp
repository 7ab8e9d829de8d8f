#include "train/classify.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <stdexcept>

#include "data/fashion_mnist.h"
#include "engine/cpu/parallel.h"
#include "engine/ops/index.h"
#include "engine/ops/loss.h"
#include "engine/optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/limits.h"
#include "train/outputs.h"
#include "train/progress.h"
#include "train/trainer.h"

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
  int64_t epochs = 0;
  for (const auto& [key, v] : flags.items()) {
    if (key == "model" || key == "quantizer")
      throw std::invalid_argument(
          "--task classify trains a fixed MLP (784-256-128-10) and takes "
          "no " +
          std::string(key == "model" ? "--hidden / --dim" : "quantizer") + " options");
    if (key == "device" && v != "cpu")
      throw std::invalid_argument("--task classify runs on the CPU only, got --device " +
                                  v.get<std::string>());
    if (key == "nproc" && v != 1)
      throw std::invalid_argument("--task classify trains on one process; --nproc " + v.dump() +
                                  " is for the VQ-VAE and quanta finetune");
    if (key == "eval_every")
      throw std::invalid_argument("--task classify evaluates once, at the end; drop --eval-every");
  }
  json j = classify_config_json(c);
  for (const char* key : {"data", "limit_train", "limit_test", "steps", "batch_size", "lr", "seed",
                          "log_every", "threads"})
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
    c.model.hidden1 = int_at(j.at("model"), "hidden1", 1, kMaxChannels);
    c.model.hidden2 = int_at(j.at("model"), "hidden2", 1, kMaxChannels);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("[classify] bad config: ") + e.what());
  }
  if (!(c.lr > 0) || !std::isfinite(c.lr))
    throw std::invalid_argument("[classify] 'lr' must be > 0, got " + std::to_string(c.lr));
  return c;
}

ClassifyResult run_classify(const ClassifyConfig& config, const std::string& out_dir,
                            bool progress_bar, std::ostream& log) {
  ClassifyConfig cfg = config;
  if (cfg.threads > 0) set_num_threads(static_cast<int>(cfg.threads));
  const data::ImageDataset train_set =
      data::load_fashion_mnist(cfg.data, data::Split::train, cfg.limit_train);
  const data::ImageDataset test_set =
      data::load_fashion_mnist(cfg.data, data::Split::test, cfg.limit_test);
  const int64_t n = train_set.size();
  if (n == 0) throw std::invalid_argument("--limit-train 0 leaves nothing to train on");
  const int64_t per_epoch = (n + cfg.batch_size - 1) / cfg.batch_size;
  if (cfg.steps < 0) cfg.steps = -cfg.steps * per_epoch;  // --epochs

  Generator gen = Generator::named(cfg.seed, "model");
  std::shared_ptr<Sequential> model = make_classifier(cfg.model, gen);
  Adam optimizer(model->parameters(), {.lr = cfg.lr});
  std::filesystem::create_directories(out_dir);
  log << "training a classifier (MLP 784-" << cfg.model.hidden1 << "-" << cfg.model.hidden2
      << "-10) on " << n << " images (" << test_set.size() << " test) from " << cfg.data << "\n"
      << "steps: " << cfg.steps << " (" << per_epoch << " per epoch, batch " << cfg.batch_size
      << ", lr " << cfg.lr << ", seed " << cfg.seed << ", " << num_threads()
      << " threads); writing to " << out_dir << "\n"
      << std::flush;

  Progress progress(log, progress_bar, 0, cfg.steps, cfg.batch_size);
  BatchOrder order(cfg.seed, n, cfg.batch_size);
  double loss_sum = 0;
  int64_t logged = 0;
  model->train();
  for (int64_t step = 0; step < cfg.steps;) {
    const Tensor idx = order.batch(step);
    const Tensor loss = cross_entropy(model->forward(index_select(train_set.images, 0, idx)),
                                      index_select(train_set.labels, 0, idx));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    ++step;
    const double l = loss.item();
    if (!std::isfinite(l))
      throw std::runtime_error("training diverged: loss " + std::to_string(l) + " at step " +
                               std::to_string(step) + " (try a smaller --lr)");
    loss_sum += l, ++logged;
    const bool log_now = step % cfg.log_every == 0 || step == cfg.steps;
    progress.update(step, (step - 1) / per_epoch + 1, loss_sum / logged, log_now);
    if (log_now) loss_sum = 0, logged = 0;
  }
  progress.finish();

  ClassifyResult r;
  r.steps = cfg.steps;
  r.test_accuracy = accuracy(*model, test_set.images, test_set.labels);
  r.test_samples = test_set.size();
  r.checkpoint = (std::filesystem::path(out_dir) / kCheckpointFile).string();
  CheckpointInfo info;
  info.format = kClassifierFormat;
  info.config = classify_config_json(cfg);
  info.step = cfg.steps;
  info.epoch = (cfg.steps + per_epoch - 1) / per_epoch;
  info.rng = {{"seed", cfg.seed}};
  info.results = {{"test_accuracy", r.test_accuracy}, {"test_samples", r.test_samples}};
  save_checkpoint(r.checkpoint, *model, nullptr, info);
  return r;
}

void run_classify_command(const json& flags, const std::string& out_dir, bool print_config,
                          bool progress_bar, std::ostream& log) {
  const ClassifyConfig cfg = classify_config(flags);
  if (print_config) {
    json j = classify_config_json(cfg);
    if (cfg.steps < 0) j["steps"] = nullptr, j["epochs"] = -cfg.steps;
    log << j.dump(2) << "\n";
    return;
  }
  const ClassifyResult r = run_classify(cfg, out_dir, progress_bar, log);
  char acc[32];
  std::snprintf(acc, sizeof acc, "%.2f%%", 100 * r.test_accuracy);
  log << "done: " << r.steps << " steps; test accuracy " << acc << " (" << r.test_samples
      << " test images)\n"
      << "checkpoint: " << r.checkpoint << "\n";
}

}  // namespace quanta::train
