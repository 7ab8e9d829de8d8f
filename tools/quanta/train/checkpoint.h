#pragma once
// Training checkpoints: one safetensors file holding the model ("model.*"),
// the optimizer state ("optim.*") and, in its string metadata, everything else
// a run needs to continue exactly:
//   format         "quanta-vqvae-1" (the classifier of `--task classify`:
//                  "quanta-classifier-1")
//   config         the merged run config (config.h), JSON
//   step, epoch    optimizer steps done, epochs begun
//   data_order     how batches are drawn (documentation of batch_indices())
//   rng            the run's random state, JSON (seed; quantizer extra state)
//   results        optional: measured figures, JSON (classifier test accuracy)
// Written atomically (io::save_safetensors), so a crash mid-write leaves the
// previous checkpoint intact.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/nn/module.h"
#include "engine/optim/optimizer.h"
#include "train/vqvae.h"

namespace quanta::train {

/** The format tag every checkpoint carries. */
inline constexpr const char* kCheckpointFormat = "quanta-vqvae-1";

/** What a checkpoint holds besides tensors. */
struct CheckpointInfo {
  nlohmann::json config;
  int64_t step = 0;
  int64_t epoch = 0;
  nlohmann::json rng = nlohmann::json::object();
  /** The format tag written and expected. */
  std::string format = kCheckpointFormat;
  /** Figures measured at the end of the run; written when not empty. */
  nlohmann::json results = nlohmann::json::object();
};

/** Writes `model`, `optimizer` (may be null: no optimizer state) and `info`
 * to `path` atomically. */
void save_checkpoint(const std::string& path, const Module& model,
                     const Optimizer* optimizer, const CheckpointInfo& info);

/** A loaded checkpoint: its info and the state dicts (prefixes removed). */
struct Checkpoint {
  CheckpointInfo info;
  StateDict model;
  StateDict optimizer;
};

/** Reads and checks a checkpoint (format tag `format`, metadata); errors name
 * `path`. */
Checkpoint load_checkpoint(const std::string& path,
                           const std::string& format = kCheckpointFormat);

/** The model a checkpoint holds, rebuilt from its config and loaded, in eval
 * mode; errors name `path`. */
std::unique_ptr<VqVae> restore_model(const Checkpoint& ck, const std::string& path);

}  // namespace quanta::train
