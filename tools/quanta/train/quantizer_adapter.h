#pragma once
// The one adapter from quant::Quantizer to TrainQuantizer, and what the
// family builders (quantizer_vq.cpp, quantizer_scalar.cpp) share: reading the
// options of a validated "quantizer" object with their defaults.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/random/generator.h"
#include "engine/tensor.h"
#include "quant/option_json.h"
#include "quant/quantizer.h"
#include "quant/sync/quantizer_sync.h"
#include "train/quantizer.h"
#include "train/quantizer_config.h"

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

/** Reads into `opts` every option of quantizer type `type` that names one of
 * its fields (quant's for_each_option: the reference's names): the value the
 * config gives, else the field's present value, recorded as the default.
 * Unset optional fields (they follow from other options in the layer) and
 * sizes of 0 (derived) are not recorded, as no config could spell them. */
template <class Options>
void read_options(QuantizerOptions& config, const std::string& type, Options& opts) {
  for_each_option(opts, [&](std::string_view name, auto& field, quant::OptionKind kind) {
    const std::string key(name);
    if (!option_applies(key, type)) return;
    if (config.given().contains(key)) {
      quant::read_option("[config] quantizer", name, config.given()[key], field, kind);
      return;
    }
    const nlohmann::json value = quant::option_json(field, kind);
    if (!value.is_null()) config.record(key, value);
  });
}

/** The generator a run seeded with `seed` builds its layer from (parameters,
 * codes and the seeds of its internal streams): the stream "quantizer" of
 * the run seed. Every family is built from it the same way. */
Generator layer_generator(uint64_t seed);

/** What every adapter with quantizer state shares: the step count that keys
 * the layer's random streams and quant::QuantizerSync, the one point per
 * optimizer step where the codebook state is applied and reconciled. The
 * layer's StepKeyed streams are pinned to the step from the first forward
 * (derived constructors call pin_streams()), so --resume draws what the
 * uninterrupted run drew; the step count is the extra state. */
class SyncedQuantizer : public TrainQuantizer {
 public:
  /** Reconciles module()'s state over `group` from now on (QuantizerSync). */
  void set_group(dist::ProcessGroup& group) override;
  /** QuantizerSync::sync_state() (over a world of one unless set_group was
   * called), then counts the step. */
  void after_step() override;
  nlohmann::json extra_state() const override { return {{"steps", steps_}}; }
  void load_extra_state(const nlohmann::json& state) override;

 protected:
  /** Pins the layer's random streams to the step count (QuantizerSync does
   * from its first reconciliation on). */
  void pin_streams();

 private:
  quant::QuantizerSync& sync();

  int64_t steps_ = 0;
  std::shared_ptr<dist::ProcessGroup> own_group_;  // a world of one, when no group is set
  std::unique_ptr<quant::QuantizerSync> sync_;
};

/** Every quantizer family behind TrainQuantizer: forward, decode and quantize
 * dropout through quant::Quantizer, codebook state reconciled by
 * SyncedQuantizer. Quantize dropout is keyed by the run seed's stream
 * "quantize_dropout". Grouped layers' indices [G, B, H, W, Q] are shown as
 * [B, H, W, G * Q], group-major. */
class LayerQuantizer final : public SyncedQuantizer {
 public:
  /** `type` is the config's ("vq", "rfsq", ...), for errors; `dim` the
   * feature channels of the input [B, dim, H, W]. */
  LayerQuantizer(std::shared_ptr<quant::Quantizer> layer, std::string type, int64_t dim,
                 uint64_t seed);

  quant::QuantizeOutput forward(const Tensor& z) override;
  Tensor decode(const Tensor& indices) override;
  int64_t codebook_size() const override { return layer_->codebook_size(); }
  int64_t num_codebooks() const override { return layer_->num_codebooks(); }
  std::string codebook_name(int64_t i) const override;
  std::shared_ptr<Module> module() override { return layer_; }
  /** LFQ's loss is: its token means are cross-rank means under QuantizerSync. */
  bool loss_is_global() const override { return loss_is_global_; }

 private:
  std::shared_ptr<quant::Quantizer> layer_;
  std::string type_;
  int64_t dim_ = 0;
  bool loss_is_global_ = false;
  int64_t groups_ = 0;  // a grouped layer's groups; 0: not grouped
};

/** Checks that z is the feature map [B, dim, H, W] quantizer `type` takes;
 * std::invalid_argument naming it otherwise. */
void check_features(const Tensor& z, const std::string& type, int64_t dim);

/** The VQ family: "vq", "rvq", "grvq", "simvq"; null for other types. */
std::unique_ptr<TrainQuantizer> make_vq_family(const std::string& type, QuantizerOptions& config,
                                               int64_t dim, uint64_t seed);
/** The scalar family: "fsq", "rfsq", "lfq", "rlfq"; null for other types. */
std::unique_ptr<TrainQuantizer> make_scalar_family(const std::string& type,
                                                   QuantizerOptions& config, int64_t dim,
                                                   uint64_t seed);
/** HierarchicalVQ: "hvq"; null for other types. */
std::unique_ptr<TrainQuantizer> make_hierarchical(const std::string& type, QuantizerOptions& config,
                                                  int64_t dim, uint64_t seed);

}  // namespace quanta::train::detail
