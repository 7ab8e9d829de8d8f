#pragma once
// `quanta train`'s VQ-VAE task: data, model, loss, evaluation and pictures,
// run by the one training loop (loop.h) with its checkpoints, metrics,
// progress and SIGINT / SIGTERM handling.
#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/tensor.h"
#include "train/batch_order.h"
#include "train/loop.h"
#include "train/metrics.h"
#include "train/vqvae.h"

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
  /** Forward and backward as one captured graph on CUDA and sim
   * (LoopSettings::graph); false: every kernel launched as called. */
  bool graph = true;
  /** The VQ-VAE's activations between convolutions (VqVae::
   * set_activation_layout): as the device prefers unless forced. */
  ActivationLayout layout = ActivationLayout::automatic;
  /** --profile: steps whose kernel calls are counted and timed. */
  ProfileSettings profile{};
};

/** How a run ended. */
struct TrainResult {
  int64_t step = 0;         // optimizer steps done in total
  int64_t total_steps = 0;  // the steps the run was asked for
  bool interrupted = false;
  int rank = 0;          // this process's rank (only rank 0 writes and evaluates)
  EvalResult last_eval;  // the last evaluation (samples == 0 when none ran)
};

/** Runs (or resumes) a training job, printing progress on `log`. SIGINT and
 * SIGTERM during the run finish the current step, write the checkpoint and
 * return with `interrupted` set. Throws on bad configs and files. */
TrainResult run_training(const TrainJob& job, std::ostream& log);

}  // namespace quanta::train
