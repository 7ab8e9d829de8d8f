#pragma once
// The configuration of a training run, as one JSON object:
//   {"data": DIR, "limit_train": N, "limit_test": N, "steps": N, "epochs": N,
//    "batch_size": B, "lr": X, "lr_schedule": "constant", "warmup_steps": N,
//    "weight_decay": X, "recon_loss": "mse", "seed": S, "log_every": N, "eval_every": N,
//    "threads": N, "device": "cpu", "nproc": N, "precision": "f32",
//    "model": {"hidden": C, "dim": D, "latent_norm_groups": G, "arch": "conv"},
//    "quantizer": {"type": "vq", ...options (quantizer_config.h)}}
// Layers apply in order: defaults, the --config file, the command-line flags,
// each one key by key (also inside "model" and "quantizer"). The merged object
// is stored in every checkpoint, so eval / encode / decode rebuild the model
// from the checkpoint alone.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace quanta::train {

/** Sizes of the VQ-VAE (vqvae.h). */
struct ModelConfig {
  /** Channels of the hidden convolutions. */
  int64_t hidden = 32;
  /** Channels of the latent map the quantizer sees (D of [B, D, 7, 7]). */
  int64_t dim = 16;
  /** Groups of a GroupNorm without affine parameters in front of the
   * encoder's last (1x1) convolution; 0: none. It fixes the scale of what
   * the projection to the quantizer sees, as vector-quantize-pytorch's
   * examples do. A divisor of `hidden`. */
  int64_t latent_norm_groups = 0;
  /** "conv" (the model above) or "vqp-example" (vector-quantize-pytorch's
   * examples' autoencoder; vqvae.h). */
  std::string arch = "conv";
};

/** Every setting of a training run (see the layout at the top). */
struct TrainConfig {
  std::string data;
  int64_t limit_train = -1;  // -1: the whole split
  int64_t limit_test = -1;
  int64_t steps = 0;  // exactly one of steps / epochs is > 0
  int64_t epochs = 0;
  int64_t batch_size = 64;
  double lr = 2e-3;
  /** The lr over the run: "constant", "linear" or "cosine" (both to 0 at
   * the last step), each after `warmup_steps` of linear warmup from 0. */
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  /** AdamW's decoupled weight decay; 0: Adam. */
  double weight_decay = 0;
  /** The reconstruction loss: "mse" or "l1" (mean absolute error), in the
   * model's image units (VqVae::image_scale). */
  std::string recon_loss = "mse";
  uint64_t seed = 0;
  int64_t log_every = 50;
  int64_t eval_every = 0;  // 0: at the end of every epoch
  int64_t threads = 0;     // 0: the engine's default (all cores)
  std::string device = "cpu";
  int64_t nproc = 1;
  /** "f32", or "bf16": the model's products (convolutions, linear layers)
   * in bf16 with f32 sums under MixedPrecision (engine/precision.h);
   * weights, optimizer state, the quantizer's math and the losses stay f32. */
  std::string precision = "f32";
  ModelConfig model;
  nlohmann::json quantizer;
};

/** The defaults as a config object. */
nlohmann::json default_config_json();

/** `base` with `layer` applied key by key ("model" and "quantizer" merged per
 * option). A layer that sets "steps" but not "epochs" clears "epochs" and
 * vice versa; a layer setting both (non-zero) is an error. */
nlohmann::json merge_config(nlohmann::json base, const nlohmann::json& layer);

/** What the quantizer a config asks for trains with on this model where the
 * config leaves it out: a layer over default_config_json() that sets the
 * type and, for the scalar families, the latent width and norm, the learning
 * rate and the levels (docs/train.md, "Recipes"). `asked` is the merged
 * layers of the config file and flags; the latent width follows the levels
 * or the LFQ codebook size they give, so that the encoder writes the
 * quantizer's dimensions itself. */
nlohmann::json recipe_layer(const nlohmann::json& asked);

/** The config of a new run: default_config_json(), then the recipe for what
 * `layers` (config file, flags) ask for, then `layers` in order, so that any
 * setting a layer gives wins. */
nlohmann::json compose_config(const std::vector<nlohmann::json>& layers);

/** Parses and validates a full config object (unknown keys, types, ranges,
 * the quantizer object); throws std::invalid_argument with one line naming the
 * key and what is wrong. */
TrainConfig config_from_json(const nlohmann::json& j);

/** The config object of `c` (round-trips through config_from_json). */
nlohmann::json config_to_json(const TrainConfig& c);

/** `config` (validated) with the quantizer's options resolved: the defaults
 * its type fills in written out (resolved_quantizer_config). What
 * --print-config prints and metrics.jsonl's header records. */
nlohmann::json resolved_config(const nlohmann::json& config);

/** Reads a JSON config file; errors name the file. */
nlohmann::json read_config_file(const std::string& path);

/** The first setting whose change would make a resumed run differ from the
 * run its checkpoint came from (batch size, lr, seed, training subset, model,
 * quantizer), as "key: checkpoint X, now Y"; empty when there is none. */
std::string resume_conflict(const nlohmann::json& checkpoint, const nlohmann::json& now);

}  // namespace quanta::train
