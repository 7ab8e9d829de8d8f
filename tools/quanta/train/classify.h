#pragma once
// `quanta train --task classify`: fits the classifier (classifier.h) to
// Fashion-MNIST with Adam and cross entropy, reports the test accuracy and
// writes a classifier checkpoint (checkpoint.h, format "quanta-classifier-1",
// no optimizer state) whose metadata holds the config and the accuracy.
// Its config object:
//   {"task": "classify", "data": DIR, "limit_train": N, "limit_test": N,
//    "steps": N, "batch_size": B, "lr": X, "seed": S, "log_every": N,
//    "threads": N, "model": {"hidden1": H1, "hidden2": H2}}
#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "train/classifier.h"

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
  int64_t threads = 0;  // 0: the engine's default (all cores)
  ClassifierShape model;
};

/** The config of `flags` (the keys quanta train's flags set, config.h names:
 * steps or epochs, batch_size, lr, seed, data, limit_train, limit_test,
 * log_every, threads; device "cpu" and nproc 1 only) over the defaults.
 * Throws std::invalid_argument naming the first flag classify does not take. */
ClassifyConfig classify_config(const nlohmann::json& flags);

/** The config object of `c` (stored in the checkpoint). */
nlohmann::json classify_config_json(const ClassifyConfig& c);
/** Reads the config object a classifier checkpoint holds; throws
 * std::invalid_argument naming the bad key. */
ClassifyConfig classify_config_from_json(const nlohmann::json& j);

/** How a run ended. */
struct ClassifyResult {
  int64_t steps = 0;
  double test_accuracy = 0;
  int64_t test_samples = 0;
  std::string checkpoint;
};

/** Trains, evaluates and writes `out_dir`/checkpoint.safetensors, logging on
 * `log` (`progress_bar`: a redrawn bar instead of plain lines). */
ClassifyResult run_classify(const ClassifyConfig& cfg, const std::string& out_dir,
                            bool progress_bar, std::ostream& log);

/** What `quanta train --task classify` does with its flags' config layer:
 * prints the config (`print_config`) or runs and prints the result lines.
 * Bad settings throw std::invalid_argument. */
void run_classify_command(const nlohmann::json& flags, const std::string& out_dir,
                          bool print_config, bool progress_bar, std::ostream& log);

}  // namespace quanta::train
