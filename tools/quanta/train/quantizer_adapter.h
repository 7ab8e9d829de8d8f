#pragma once
// What the quantizer adapters (quantizer_vq.cpp, quantizer_scalar.cpp) share:
// reading the options of a validated "quantizer" object with the adapter's
// defaults, the step count that keys their random draws, and the layout
// change their layers' channel-last decodes need.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/random/generator.h"
#include "engine/tensor.h"
#include "quant/sync/quantizer_sync.h"
#include "train/quantizer.h"

namespace quanta::train::detail {

/** A validated "quantizer" object as an adapter reads it: every option read
 * is recorded with the value used, given or the adapter's default, so the
 * configuration a run resolves to can be shown (resolved_quantizer_config). */
class QuantizerOptions {
 public:
  explicit QuantizerOptions(const nlohmann::json& given) : given_(given), resolved_(given) {}
  const nlohmann::json& given() const { return given_; }
  /** The given object plus every default an adapter read. */
  const nlohmann::json& resolved() const { return resolved_; }
  /** Records `value` for `key` unless the config gave one. */
  void record(const std::string& key, const nlohmann::json& value);

 private:
  const nlohmann::json& given_;
  nlohmann::json resolved_;
};

/** Option `key` of `config`, or `fallback` when absent (the config is
 * validated: present values have the right JSON type). A fallback of 0 for
 * an integer means "derived" (codebook_dim: from the latent) and is not
 * recorded, as no config could spell it. */
int64_t option_int(QuantizerOptions& config, const std::string& key, int64_t fallback);
double option_number(QuantizerOptions& config, const std::string& key, double fallback);
bool option_bool(QuantizerOptions& config, const std::string& key, bool fallback);
std::vector<int64_t> option_list(QuantizerOptions& config, const std::string& key,
                                 const std::vector<int64_t>& fallback);

/** The seed of the layer built for a run seeded with `seed` (its parameters,
 * codes and internal streams): the stream "quantizer" of the run seed. */
Generator layer_generator(uint64_t seed);

/** [B, H, W, D] (a layer's channel-last decode) to [B, D, H, W]. */
Tensor channels_first(const Tensor& y);

/** Throws std::invalid_argument unless `z` is a feature map [B, dim, H, W]. */
void check_features(const Tensor& z, int64_t dim, const std::string& type);

/** Base of the adapters: counts optimizer steps (after_step) and saves the
 * count as extra state. Random draws the adapter makes itself (quantize
 * dropout) are keyed by (run seed, step), never continued from earlier draws,
 * so a resumed run draws exactly what the uninterrupted one did. */
class StepKeyedQuantizer : public TrainQuantizer {
 public:
  explicit StepKeyedQuantizer(uint64_t seed) : seed_(seed) {}
  /** Reconciles module()'s state over `group` from now on (QuantizerSync). */
  void set_group(dist::ProcessGroup& group) override;
  /** QuantizerSync::sync_state() (over a world of one unless set_group was
   * called), then counts the step. */
  void after_step() override;
  nlohmann::json extra_state() const override { return {{"steps", steps_}}; }
  void load_extra_state(const nlohmann::json& state) override;

  /** Optimizer steps taken so far. */
  int64_t steps() const { return steps_; }

 protected:
  /** Quantize dropout's last kept layer of `num_layers` for this training
   * step: uniform in [0, num_layers - 1] from the stream "quantize_dropout"
   * of the run seed at offset {0, step}; -1 (keep all) when `dropout` is off,
   * there is one layer, or module() is in eval mode. */
  int64_t dropout_last_layer(bool dropout, int64_t num_layers);

 private:
  quant::QuantizerSync& sync();

  uint64_t seed_;
  int64_t steps_ = 0;
  std::shared_ptr<dist::ProcessGroup> own_group_;  // a world of one, when no group is set
  std::unique_ptr<quant::QuantizerSync> sync_;
};

/** The VQ family: "vq", "rvq", "grvq", "simvq"; null for other types. */
std::unique_ptr<TrainQuantizer> make_vq_family(const std::string& type, QuantizerOptions& config,
                                               int64_t dim, uint64_t seed);
/** The scalar family: "fsq", "rfsq", "lfq", "rlfq"; null for other types. */
std::unique_ptr<TrainQuantizer> make_scalar_family(const std::string& type,
                                                   QuantizerOptions& config, int64_t dim,
                                                   uint64_t seed);

}  // namespace quanta::train::detail
