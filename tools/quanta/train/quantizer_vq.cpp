// The VQ family behind TrainQuantizer: VectorQuantize ("vq"), ResidualVQ
// ("rvq"), GroupedResidualVQ ("grvq") and SimVQ ("simvq") on [B, D, H, W]
// feature maps. Codebook state (EMA, k-means, dead codes) is updated once per
// optimizer step in after_step() through quant::QuantizerSync (reconciled
// across ranks in a data-parallel run), never inside forward.
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "quant/token_layout.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/sim_vq.h"
#include "quant/vq/vector_quantize.h"
#include "train/quantizer_adapter.h"

namespace quanta::train::detail {
namespace {

using nlohmann::json;

// Defaults for the options a config leaves out (the reference has none).
constexpr int64_t kCodebookSize = 512;
constexpr int64_t kNumQuantizers = 4;
constexpr int64_t kGroups = 2;

Tensor as_i64(const Tensor& indices) {
  return indices.dtype() == DType::i64 ? indices : indices.to(DType::i64);
}

// The options every VectorQuantize of vq / rvq / grvq takes from the config;
// the rest keep the reference's defaults.
quant::VectorQuantizeOptions vq_options(QuantizerOptions& c) {
  quant::VectorQuantizeOptions o;
  o.decay = option_number(c, "decay", o.decay);
  o.eps = option_number(c, "eps", o.eps);
  o.kmeans_init = option_bool(c, "kmeans_init", o.kmeans_init);
  o.kmeans_iters = option_int(c, "kmeans_iters", o.kmeans_iters);
  o.threshold_ema_dead_code = option_number(c, "threshold_ema_dead_code", 0.0);
  o.commitment_weight = option_number(c, "commitment_weight", o.commitment_weight);
  o.use_cosine_sim = option_bool(c, "use_cosine_sim", o.use_cosine_sim);
  o.orthogonal_reg_weight = option_number(c, "orthogonal_reg_weight", 0.0);
  // Unset, these follow from other options in the layer: nothing to record.
  const json& given = c.given();
  if (given.contains("learnable_codebook"))
    o.learnable_codebook = given["learnable_codebook"].get<bool>();
  if (given.contains("ema_update")) o.ema_update = given["ema_update"].get<bool>();
  if (given.contains("rotation_trick")) o.rotation_trick = given["rotation_trick"].get<bool>();
  o.update_in_forward = false;  // after_step() reconciles, then applies the statistics
  return o;
}

class VqQuantizer : public StepKeyedQuantizer {
 public:
  VqQuantizer(QuantizerOptions& c, int64_t dim, uint64_t seed)
      : StepKeyedQuantizer(seed), dim_(dim) {
    quant::VectorQuantizeOptions o = vq_options(c);
    o.dim = dim;
    o.codebook_size = option_int(c, "codebook_size", kCodebookSize);
    o.heads = option_int(c, "heads", 1);
    o.codebook_dim = option_int(c, "codebook_dim", 0);
    if (o.codebook_dim == 0 && o.heads > 1) {
      // Each head quantizes its own slice of the latent (no projections).
      if (dim % o.heads != 0)
        throw std::invalid_argument("[quantizer vq] dim " + std::to_string(dim) +
                                    " is not a multiple of heads " + std::to_string(o.heads) +
                                    "; give --codebook-dim");
      o.codebook_dim = dim / o.heads;
    }
    o.accept_image_fmap = true;
    Generator gen = layer_generator(seed);
    layer_ = std::make_shared<quant::VectorQuantize>(o, gen);
  }

  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, dim_, "vq");
    quant::QuantizeOutput out = layer_->forward(z);
    out.indices = as_i64(out.indices);
    return out;
  }
  Tensor decode(const Tensor& indices) override {
    return channels_first(layer_->get_output_from_indices(as_i64(indices)));
  }
  int64_t codebook_size() const override { return layer_->options().codebook_size; }
  int64_t num_codebooks() const override { return layer_->options().heads; }
  std::shared_ptr<Module> module() override { return layer_; }

 private:
  int64_t dim_;
  std::shared_ptr<quant::VectorQuantize> layer_;
};

quant::ResidualVQOptions rvq_options(QuantizerOptions& c, int64_t dim) {
  quant::ResidualVQOptions o;
  o.dim = dim;
  o.num_quantizers = option_int(c, "num_quantizers", kNumQuantizers);
  o.codebook_sizes = {option_int(c, "codebook_size", kCodebookSize)};
  o.codebook_dim = option_int(c, "codebook_dim", 0);
  o.shared_codebook = option_bool(c, "shared_codebook", false);
  o.quantize_dropout = option_bool(c, "quantize_dropout", false);
  o.update_in_forward = false;
  o.layer = vq_options(c);
  return o;
}

class RvqQuantizer : public StepKeyedQuantizer {
 public:
  RvqQuantizer(QuantizerOptions& c, int64_t dim, uint64_t seed)
      : StepKeyedQuantizer(seed), dim_(dim) {
    quant::ResidualVQOptions o = rvq_options(c, dim);
    o.accept_image_fmap = true;
    Generator gen = layer_generator(seed);
    layer_ = std::make_shared<quant::ResidualVQ>(o, gen);
  }

  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, dim_, "rvq");
    // The dropout decision is the adapter's (keyed by the step), not the
    // layer's own stream, so --resume draws what the uninterrupted run drew.
    const int64_t last =
        dropout_last_layer(layer_->options().quantize_dropout, layer_->num_quantizers());
    quant::QuantizeOutput out = layer_->forward_with_last_layer(z, Tensor(), last);
    out.indices = as_i64(out.indices);
    return out;
  }
  Tensor decode(const Tensor& indices) override {
    return channels_first(layer_->get_output_from_indices(as_i64(indices)));
  }
  int64_t codebook_size() const override { return layer_->options().codebook_sizes.at(0); }
  int64_t num_codebooks() const override { return layer_->num_quantizers(); }
  std::shared_ptr<Module> module() override { return layer_; }

 private:
  int64_t dim_;
  std::shared_ptr<quant::ResidualVQ> layer_;
};

// Indices are [B, H, W, groups * num_quantizers], group-major.
class GrvqQuantizer : public StepKeyedQuantizer {
 public:
  GrvqQuantizer(QuantizerOptions& c, int64_t dim, uint64_t seed)
      : StepKeyedQuantizer(seed), dim_(dim), groups_(option_int(c, "groups", kGroups)) {
    if (dim % groups_ != 0)
      throw std::invalid_argument("[quantizer grvq] dim " + std::to_string(dim) +
                                  " is not a multiple of groups " + std::to_string(groups_));
    quant::GroupedResidualVQOptions o;
    o.dim = dim;
    o.groups = groups_;
    o.accept_image_fmap = true;
    o.rvq = rvq_options(c, dim / groups_);
    dropout_ = o.rvq.quantize_dropout;
    levels_ = o.rvq.num_quantizers;
    codebook_size_ = o.rvq.codebook_sizes.at(0);
    Generator gen = layer_generator(seed);
    layer_ = std::make_shared<quant::GroupedResidualVQ>(o, gen);
  }

  // GroupedResidualVQ::forward with the dropout decision made here: the
  // groups' ResidualVQs run on their channel slices, all dropping alike.
  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, dim_, "grvq");
    const int64_t last = dropout_last_layer(dropout_, levels_);
    const quant::TokenLayout layout(z, false, dim_, "quantizer grvq");
    const std::vector<Tensor> parts = chunk(layout.to_tokens(z), groups_, -1);
    std::vector<Tensor> qs, idx, losses;
    for (int64_t g = 0; g < groups_; ++g) {
      quant::QuantizeOutput o =
          layer_->rvq(g).forward_with_last_layer(parts[static_cast<size_t>(g)], Tensor(), last);
      qs.push_back(o.quantized);
      idx.push_back(as_i64(layout.spatial_from_tokens(o.indices)));  // [B, H, W, Q]
      losses.push_back(o.loss);
    }
    quant::QuantizeOutput out;
    out.quantized = layout.from_tokens(cat(qs, -1));
    const Tensor stacked = stack(idx, -2);  // [B, H, W, G, Q]
    out.indices = reshape(stacked, {z.size(0), z.size(2), z.size(3), groups_ * levels_});
    out.loss = stack(losses);  // [G, Q]
    return out;
  }
  Tensor decode(const Tensor& indices) override {
    if (indices.dim() != 4 || indices.size(3) != groups_ * levels_)
      throw std::invalid_argument("[quantizer grvq] expected indices [B, H, W, " +
                                  std::to_string(groups_ * levels_) + "], got " +
                                  shape_str(indices.shape()));
    const Tensor per_group = reshape(
        as_i64(indices), {indices.size(0), indices.size(1), indices.size(2), groups_, levels_});
    const Tensor grouped = contiguous(permute(per_group, {3, 0, 1, 2, 4}));  // [G, B, H, W, Q]
    return channels_first(layer_->get_output_from_indices(grouped));
  }
  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return groups_ * levels_; }
  std::shared_ptr<Module> module() override { return layer_; }

 private:
  int64_t dim_, groups_, levels_ = 0, codebook_size_ = 0;
  bool dropout_ = false;
  std::shared_ptr<quant::GroupedResidualVQ> layer_;
};

// SimVQ has no state besides its parameters: after_step only counts.
class SimVqQuantizer : public StepKeyedQuantizer {
 public:
  SimVqQuantizer(QuantizerOptions& c, int64_t dim, uint64_t seed)
      : StepKeyedQuantizer(seed), dim_(dim) {
    quant::SimVQOptions o;
    o.dim = dim;
    o.codebook_size = option_int(c, "codebook_size", kCodebookSize);
    o.frozen_codebook_dim = option_int(c, "codebook_dim", 0);
    o.channel_first = true;
    o.rotation_trick = option_bool(c, "rotation_trick", o.rotation_trick);
    o.commitment_weight = option_number(c, "commitment_weight", o.commitment_weight);
    Generator gen = layer_generator(seed);
    layer_ = std::make_shared<quant::SimVQ>(o, gen);
  }

  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, dim_, "simvq");
    quant::QuantizeOutput out = layer_->forward(z);
    out.indices = as_i64(out.indices);
    return out;
  }
  Tensor decode(const Tensor& indices) override {
    // Channel-first layer: codes of [B, H, W] indices come as [B, D, H, W].
    return contiguous(layer_->indices_to_codes(as_i64(indices)));
  }
  int64_t codebook_size() const override { return layer_->options().codebook_size; }
  std::shared_ptr<Module> module() override { return layer_; }

 private:
  int64_t dim_;
  std::shared_ptr<quant::SimVQ> layer_;
};

}  // namespace

std::unique_ptr<TrainQuantizer> make_vq_family(const std::string& type, QuantizerOptions& config,
                                               int64_t dim, uint64_t seed) {
  if (type == "vq") return std::make_unique<VqQuantizer>(config, dim, seed);
  if (type == "rvq") return std::make_unique<RvqQuantizer>(config, dim, seed);
  if (type == "grvq") return std::make_unique<GrvqQuantizer>(config, dim, seed);
  if (type == "simvq") return std::make_unique<SimVqQuantizer>(config, dim, seed);
  return nullptr;
}

}  // namespace quanta::train::detail
