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
#include "quant/vq/vq_option_fields.h"
#include "train/quantizer_adapter.h"

namespace quanta::train::detail {
namespace {

using nlohmann::json;

// Defaults for the options a config leaves out (the reference has none).
constexpr int64_t kCodebookSize = 512;
constexpr int64_t kNumQuantizers = 4;
constexpr int64_t kGroups = 2;

std::unique_ptr<TrainQuantizer> vq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  quant::VectorQuantizeOptions o;
  o.dim = dim;
  o.codebook_size = kCodebookSize;
  read_options(c, "vq", o);
  if (o.codebook_dim == 0 && o.heads > 1) {
    // Each head quantizes its own slice of the latent (no projections).
    if (dim % o.heads != 0)
      throw std::invalid_argument("[quantizer vq] dim " + std::to_string(dim) +
                                  " is not a multiple of heads " + std::to_string(o.heads) +
                                  "; give --codebook-dim");
    o.codebook_dim = dim / o.heads;
  }
  o.accept_image_fmap = true;
  o.update_in_forward = false;  // after_step() reconciles, then applies the statistics
  Generator gen = layer_generator(seed);
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::VectorQuantize>(o, gen), "vq",
                                          dim, seed);
}

// The defaults of a residual stack of the config (its layers' as vq's).
quant::ResidualVQOptions rvq_defaults(int64_t dim) {
  quant::ResidualVQOptions o;
  o.dim = dim;
  o.num_quantizers = kNumQuantizers;
  o.codebook_sizes = {kCodebookSize};
  o.update_in_forward = false;
  return o;
}

std::unique_ptr<TrainQuantizer> rvq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  quant::ResidualVQOptions o = rvq_defaults(dim);
  read_options(c, "rvq", o);
  o.accept_image_fmap = true;
  Generator gen = layer_generator(seed);
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::ResidualVQ>(o, gen), "rvq", dim,
                                          seed);
}

// Indices are [B, H, W, groups * num_quantizers], group-major.
std::unique_ptr<TrainQuantizer> grvq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  quant::GroupedResidualVQOptions o;
  o.dim = dim;
  o.groups = kGroups;
  o.accept_image_fmap = true;
  o.rvq = rvq_defaults(0);
  read_options(c, "grvq", o);
  if (dim % o.groups != 0)
    throw std::invalid_argument("[quantizer grvq] dim " + std::to_string(dim) +
                                " is not a multiple of groups " + std::to_string(o.groups));
  Generator gen = layer_generator(seed);
  return std::make_unique<LayerQuantizer>(std::make_shared<quant::GroupedResidualVQ>(o, gen),
                                          "grvq", dim, seed);
}

// SimVQ has no state besides its parameters: after_step only counts. The
// config's codebook_dim is its frozen codebook's width.
std::unique_ptr<TrainQuantizer> simvq(QuantizerOptions& c, int64_t dim, uint64_t seed) {
  quant::SimVQOptions o;
  o.dim = dim;
  o.codebook_size = kCodebookSize;
  read_options(c, "simvq", o);
  o.frozen_codebook_dim = option_int(c, "codebook_dim", 0);
  o.channel_first = true;
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
