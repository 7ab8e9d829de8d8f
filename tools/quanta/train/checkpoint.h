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
//   log_window     optional: the sums of the metrics record in progress, JSON
//                  (so a resumed run's next record covers the same steps)
//   results        optional: measured figures, JSON (classifier test accuracy)
// Written atomically (io::save_safetensors), so a crash mid-write leaves the
// previous checkpoint intact.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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
  /** The partial sums of the next metrics record (trainer.cpp); written
   * when not empty. */
  nlohmann::json log_window = nlohmann::json::object();
};

/** Writes `model`, `optimizer` (may be null: no optimizer state) and `info`
 * to `path` atomically. */
void save_checkpoint(const std::string& path, const Module& model, const Optimizer* optimizer,
                     const CheckpointInfo& info);
/** The same with the model's tensors given as a state dict (a task that
 * keeps only part of its model, such as a fine-tune's adapters). */
void save_checkpoint(const std::string& path, const StateDict& model_state,
                     const Optimizer* optimizer, const CheckpointInfo& info);
/** The same with the optimizer's state given as its state dict (gathered
 * from the ranks that shard it). */
void save_checkpoint(const std::string& path, const StateDict& model_state,
                     const StateDict& optimizer_state, const CheckpointInfo& info);

/** A loaded checkpoint: its info and the state dicts (prefixes removed). */
struct Checkpoint {
  CheckpointInfo info;
  StateDict model;
  StateDict optimizer;
};

/** Reads and checks a checkpoint (format tag `format`, metadata); errors name
 * `path`. */
Checkpoint load_checkpoint(const std::string& path, const std::string& format = kCheckpointFormat);

/** The model tensors of `ck` (floating ones) that hold a NaN or an Inf, in
 * file order: a model that trained into NaN, or a damaged file. */
std::vector<std::string> non_finite_tensors(const Checkpoint& ck);

/** "'model.x' holds NaN or Inf values" (and how many more do) for errors and
 * warnings about `ck` at `path`; empty when every tensor is finite. */
std::string non_finite_summary(const Checkpoint& ck, const std::string& path);

/** A 64-bit FNV-1a hash of the model tensors of `ck` (names, shapes and
 * bytes), as 16 hex digits: `quanta encode` records it so that `decode` can
 * tell codes made by another model. */
std::string model_fingerprint(const Checkpoint& ck);

/** The model a checkpoint holds, rebuilt from its config and loaded, in eval
 * mode; errors name `path`. */
std::unique_ptr<VqVae> restore_model(const Checkpoint& ck, const std::string& path);

}  // namespace quanta::train
