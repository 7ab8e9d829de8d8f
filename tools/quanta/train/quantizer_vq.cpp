// The VQ family's layers built from a "quantizer" config: VectorQuantize
// ("vq"), ResidualVQ ("rvq"), GroupedResidualVQ ("grvq") and SimVQ ("simvq")
// on [B, D, H, W] feature maps, driven by LayerQuantizer. Codebook state (EMA,
// k-means, dead codes) is updated once per optimizer step in after_step()
// through quant::QuantizerSync, never inside forward (update_in_forward off).
#include <memory>
#include <stdexcept>
#include <string>

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

std::unique_ptr<TrainQuantizer> vq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
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
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::VectorQuantize>(o, gen), "vq",
                                          dim, seed);
}

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

std::unique_ptr<TrainQuantizer> rvq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  quant::ResidualVQOptions o = rvq_options(c, dim);
  o.accept_image_fmap = true;
  Generator gen = layer_generator(seed);
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::ResidualVQ>(o, gen), "rvq", dim,
                                          seed);
}

// Indices are [B, H, W, groups * num_quantizers], group-major.
std::unique_ptr<TrainQuantizer> grvq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  const int64_t groups = option_int(c, "groups", kGroups);
  if (dim % groups != 0)
    throw std::invalid_argument("[quantizer grvq] dim " + std::to_string(dim) +
                                " is not a multiple of groups " + std::to_string(groups));
  quant::GroupedResidualVQOptions o;
  o.dim = dim;
  o.groups = groups;
  o.accept_image_fmap = true;
  o.rvq = rvq_options(c, dim / groups);
  Generator gen = layer_generator(seed);
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::GroupedResidualVQ>(o, gen),
                                          "grvq", dim, seed);
}

// SimVQ has no state besides its parameters: after_step only counts.
std::unique_ptr<TrainQuantizer> simvq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  quant::SimVQOptions o;
  o.dim = dim;
  o.codebook_size = option_int(c, "codebook_size", kCodebookSize);
  o.frozen_codebook_dim = option_int(c, "codebook_dim", 0);
  o.channel_first = true;
  o.rotation_trick = option_bool(c, "rotation_trick", o.rotation_trick);
  o.commitment_weight = option_number(c, "commitment_weight", o.commitment_weight);
  Generator gen = layer_generator(seed);
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::SimVQ>(o, gen), "simvq", dim,
                                          seed);
}

}  // namespace

std::unique_ptr<TrainQuantizer> make_vq_family(const std::string& type, QuantizerOptions& config,
                                               int64_t dim, uint64_t seed) {
  if (type == "vq") return vq(config, dim, seed);
  if (type == "rvq") return rvq(config, dim, seed);
  if (type == "grvq") return grvq(config, dim, seed);
  if (type == "simvq") return simvq(config, dim, seed);
  return nullptr;
}

}  // namespace quanta::train::detail
