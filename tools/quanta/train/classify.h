#pragma once
// `quanta train --task classify`: fits the classifier (classifier.h) to
// Fashion-MNIST with Adam and cross entropy through the training loop
// (loop.h: progress, metrics.jsonl, SIGTERM checkpoints, --resume), reports
// the test accuracy and writes a classifier checkpoint (checkpoint.h, format
// "quanta-classifier-1", with its optimizer state) whose metadata holds the
// config and, once the run is complete, the accuracy.
// Its config object:
//   {"task": "classify", "data": DIR, "limit_train": N, "limit_test": N,
//    "steps": N, "batch_size": B, "lr": X, "seed": S, "log_every": N,
//    "threads": N, "device": "cpu", "model": {"hidden1": H1, "hidden2": H2}}
// ("device" absent, as in older checkpoints: "cpu").
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "data/fashion_mnist.h"
#include "train/classifier.h"
#include "train/loop.h"

namespace quanta::train {

/** Every setting of a classifier run (the object above). */
struct ClassifyConfig {
  std::string data;
  int64_t limit_train = -1;  // -1: the whole split
  int64_t limit_test = -1;
  int64_t steps = 1000;
  int64_t batch_size = 128;
  double lr = 1e-3;
  uint64_t seed = 0;
  int64_t log_every = 100;
  int64_t threads = 0;         // 0: the engine's default (all cores)
  std::string device = "cpu";  // --device (run_device.h); a resume may change it
  ClassifierShape model;
};

/** The config of `flags` (the keys quanta train's flags set, config.h names:
 * steps or epochs, batch_size, lr, seed, data, limit_train, limit_test,
 * log_every, threads, device; nproc 1 only) over the defaults.
 * Throws std::invalid_argument naming the first flag classify does not take. */
ClassifyConfig classify_config(const nlohmann::json& flags);
/** The same over `base`, a classifier config object (a checkpoint's). */
ClassifyConfig classify_config(const nlohmann::json& flags, const nlohmann::json& base);

/** The config object of `c` (stored in the checkpoint). */
nlohmann::json classify_config_json(const ClassifyConfig& c);
/** Reads the config object a classifier checkpoint holds; throws
 * std::invalid_argument naming the bad key. */
ClassifyConfig classify_config_from_json(const nlohmann::json& j);

/** How a run ended. */
struct ClassifyResult {
  int64_t steps = 0;
  bool interrupted = false;  // by SIGINT / SIGTERM (checkpoint written)
  double test_accuracy = 0;
  int64_t test_samples = 0;
  std::string checkpoint;
};

/** A classifier on Fashion-MNIST as a task of the training loop: mean cross
 * entropy over the global batch, test accuracy as its evaluation ("eval"
 * records: test_accuracy, test_samples; the checkpoint's results after it).
 * quanta train --task classify and quanta finetune (whose task derives from
 * it) both run it. The datasets must outlive the task. */
class ClassifierTask : public LoopTask {
 public:
  using Describe = std::function<void(std::ostream& log, int64_t start_step, int64_t total_steps)>;
  /** Moves `model` to `device`, where each batch goes (the datasets stay on
   * the host). */
  ClassifierTask(std::shared_ptr<Sequential> model, const data::ImageDataset& train,
                 const data::ImageDataset& test, Device device, Describe describe);

  std::shared_ptr<Module> model() override { return model_; }
  void describe(std::ostream& log, int64_t start_step, int64_t total_steps) const override {
    describe_(log, start_step, total_steps);
  }
  StepLoss step(const BatchShare& share) override;
  Evaluation evaluate() override;
  nlohmann::json results() const override { return results_; }
  /** Training examples. */
  int64_t examples() const { return train_.size(); }
  /** The last evaluation's test accuracy (NaN before one). */
  double test_accuracy() const;

 protected:
  std::shared_ptr<Sequential> model_;
  const data::ImageDataset& train_;
  const data::ImageDataset& test_;
  Device device_;

 private:
  Describe describe_;
  nlohmann::json results_ = nlohmann::json::object();
};

/** Where and how to run. */
struct ClassifyJob {
  std::string out_dir;
  /** Continue the run in out_dir from its checkpoint. */
  bool resume = false;
  /** A redrawn bar instead of plain log lines. */
  bool progress_bar = false;
  /** quanta's version, for metrics.jsonl's header. */
  std::string version;
  /** --profile: steps whose kernel calls are counted and timed. */
  ProfileSettings profile{};
};

/** Trains (or continues), evaluates and writes out_dir/checkpoint.safetensors
 * and metrics.jsonl, logging on `log`. */
ClassifyResult run_classify(const ClassifyConfig& cfg, const ClassifyJob& job, std::ostream& log);

/** What `quanta train --task classify` does with its flags' config layer
 * (over the checkpoint's config with `resume`): prints the config
 * (`print_config`) or runs and prints the result lines. Bad settings, and
 * with `resume` a change of what defines the run, throw
 * std::invalid_argument. */
void run_classify_command(const nlohmann::json& flags, const ClassifyJob& job, bool print_config,
                          std::ostream& log);

}  // namespace quanta::train
