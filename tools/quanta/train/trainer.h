#pragma once
// The training loop of `quanta train`: data, model, optimizer, evaluation,
// checkpoints, metrics and pictures, interruption by SIGINT / SIGTERM.
#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/tensor.h"
#include "train/metrics.h"

namespace quanta::train {

/** What to run and where. */
struct TrainJob {
  /** The merged config object (config.h); validated by run_training. */
  nlohmann::json config;
  /** Output folder (created if absent). */
  std::string out_dir;
  /** Continue from out_dir/checkpoint.safetensors (config must agree). */
  bool resume = false;
  /** Redraw a progress bar instead of printing plain log lines. */
  bool progress_bar = false;
  /** quanta's version, recorded in metrics.jsonl's header. */
  std::string version;
};

/** How a run ended. */
struct TrainResult {
  int64_t step = 0;         // optimizer steps done in total
  int64_t total_steps = 0;  // the steps the run was asked for
  bool interrupted = false;
  int rank = 0;          // this process's rank (only rank 0 writes and evaluates)
  EvalResult last_eval;  // the last evaluation (samples == 0 when none ran)
};

/** The global batch of training step `step` (0-based): positions into the
 * training set, a pure function of (seed, step, n, batch_size) so a resumed
 * run reads exactly the batches the uninterrupted one would. Epoch e =
 * step / ceil(n / batch_size) visits randperm(n) drawn from
 * Generator::named(seed, "data-order").fork("epoch-<e>"); its last batch may be
 * smaller. */
Tensor batch_indices(uint64_t seed, int64_t step, int64_t n, int64_t batch_size);

/** batch_indices() for consecutive steps, drawing each epoch's permutation
 * once instead of once per step (randperm of the 60000 training images costs
 * a few percent of a step). batch(step) == batch_indices(seed, step, n,
 * batch_size) for every step, in any order. */
class BatchOrder {
 public:
  BatchOrder(uint64_t seed, int64_t n, int64_t batch_size);
  Tensor batch(int64_t step);

 private:
  uint64_t seed_;
  int64_t n_, batch_size_;
  int64_t epoch_ = -1;  // whose permutation perm_ holds
  Tensor perm_;
};

/** Rank `rank`'s contiguous share of a global batch (its positions, in rank
 * order: rows [b r / W, b (r + 1) / W) of b), so the ranks' shares laid end
 * to end are the batch one process would take. */
Tensor rank_share(const Tensor& batch, int rank, int world);

/** Runs (or resumes) a training job, printing progress on `log`. SIGINT and
 * SIGTERM during the run finish the current step, write the checkpoint and
 * return with `interrupted` set. Throws on bad configs and files. */
TrainResult run_training(const TrainJob& job, std::ostream& log);

}  // namespace quanta::train
