#pragma once
// The quantizer seam of the training pipeline. The VQ-VAE, the training loop,
// the metrics and the checkpoints see every quantizer family (VQ, residual,
// grouped, SimVQ, FSQ, LFQ, ...) through this one interface. Every family but
// HierarchicalVQ is a quant::Quantizer, so one adapter drives them all
// (LayerQuantizer, quantizer_adapter.h); quantizer_vq.cpp and
// quantizer_scalar.cpp only build the layer that make_quantizer's config
// describes. HierarchicalVQ's levels have their own resolutions, so its
// adapter (quantizer_hierarchical.cpp) maps them onto the latent's grid.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "engine/nn/module.h"
#include "engine/tensor.h"
#include "quant/quantize_output.h"

namespace quanta::train {

/** A quantizer as the trainer uses it, on image feature maps [B, D, H, W]. */
class TrainQuantizer {
 public:
  virtual ~TrainQuantizer() = default;

  /** Quantizes z [B, D, H, W]: `quantized` has z's shape (differentiable to z
   * in train mode), `indices` are [B, H, W] (or [B, H, W, Q] with Q =
   * num_codebooks() > 1) integer codes, `loss` the auxiliary loss as the
   * layer returns it (the trainer adds its sum to the reconstruction loss). */
  virtual quant::QuantizeOutput forward(const Tensor& z) = 0;
  /** The feature map [B, D, H, W] that `indices` (as forward returns them)
   * stand for. */
  virtual Tensor decode(const Tensor& indices) = 0;
  /** Codes per codebook; 0 when there are none (no usage metrics). */
  virtual int64_t codebook_size() const = 0;
  /** Codebooks whose indices forward returns side by side (the trailing
   * index dimension when > 1): residual levels, groups, heads. */
  virtual int64_t num_codebooks() const { return 1; }
  /** What codebook `i` of forward's trailing index dimension is, for the
   * per-codebook metrics: "level 2", "group 1 level 0", "head 3"; counted
   * from 0 as the dimension is. */
  virtual std::string codebook_name(int64_t i) const { return "codebook " + std::to_string(i); }
  /** The codes of each codebook in `indices` (as forward returns them), one
   * tensor per codebook, each code once per token it quantized: what the
   * usage and perplexity metrics count. By default the trailing dimension's
   * slices (the whole tensor for one codebook); a layer whose codebooks
   * quantize at other resolutions than the latent's (HierarchicalVQ's levels)
   * returns each at its own. */
  virtual std::vector<Tensor> codes_per_codebook(const Tensor& indices) const;
  /** The layer as a Module: its parameters train with the model and its
   * parameters and buffers (codebooks, EMA statistics) are checkpointed. */
  virtual std::shared_ptr<Module> module() = 0;
  /** The group whose ranks train this quantizer together (a world of one
   * when never called): after_step() reconciles the layer's state across
   * them. Call on every rank before the first forward; the group must
   * outlive this object. */
  virtual void set_group(dist::ProcessGroup& /*group*/) {}
  /** Called after every optimizer step on every rank: applies the step's
   * codebook statistics (EMA update, dead-code expiry, deferred k-means),
   * reconciled across the group's ranks by quant::QuantizerSync, and counts
   * the step that keys the adapter's random draws. */
  virtual void after_step() {}
  /** True when `loss` is already a whole-batch quantity on every rank (LFQ's
   * token means are cross-rank means); false when it is a mean over this
   * rank's tokens. Decides how the trainer weights it across ranks. */
  virtual bool loss_is_global() const { return false; }
  /** State that is neither parameter nor buffer (random generator offsets),
   * saved in the checkpoint metadata so --resume continues exactly. */
  virtual nlohmann::json extra_state() const { return nlohmann::json::object(); }
  /** Restores what extra_state() returned. */
  virtual void load_extra_state(const nlohmann::json& /*state*/) {}
};

/** The quantizer that `config` (the "quantizer" object, validated by
 * validate_quantizer_config) describes, for features of `dim` channels;
 * `seed` keys its random streams. Options the config leaves out take the
 * defaults docs/train.md lists. Throws std::invalid_argument naming the
 * layer when the options do not fit (e.g. dim not a multiple of groups). */
std::unique_ptr<TrainQuantizer> make_quantizer(const nlohmann::json& config, int64_t dim,
                                               uint64_t seed);

/** `config` with every option the layer built from it uses, given or
 * defaulted (what --print-config shows); validated as make_quantizer does. */
nlohmann::json resolved_quantizer_config(const nlohmann::json& config, int64_t dim);

/** `--quantizer none`: the identity (a plain autoencoder baseline); no
 * codes, empty indices, zero auxiliary loss. */
class NoQuantizer : public TrainQuantizer {
 public:
  NoQuantizer();
  quant::QuantizeOutput forward(const Tensor& z) override;
  Tensor decode(const Tensor& indices) override;
  int64_t codebook_size() const override { return 0; }
  std::shared_ptr<Module> module() override { return module_; }

 private:
  std::shared_ptr<Module> module_;
};

}  // namespace quanta::train
