// The scalar family behind TrainQuantizer: FSQ ("fsq"), ResidualFSQ ("rfsq"),
// LFQ ("lfq") and ResidualLFQ ("rlfq") on [B, D, H, W] feature maps (their
// layers take rank-4 inputs as channel-first feature maps). Their codebooks
// are implicit, so there is no state to update after a step.
#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/ops/view.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"
#include "quant/vq/streams.h"
#include "train/quantizer_adapter.h"

namespace quanta::train::detail {
namespace {

using nlohmann::json;

// Defaults for the options a config leaves out.
const std::vector<int64_t> kLevels = {8, 5, 5, 5};  // 1000 codes of 4 dimensions
constexpr int64_t kRlfqCodebookSize = 512;          // 9 bits per level
// LFQ: one bit per latent channel (no projections, the reference's default),
// at most 16 bits per codebook: 2^16 codes already cost 3x the step time of 2^9
// in the entropy terms (docs/train.md).
constexpr int64_t kLfqMaxBits = 16;
constexpr int64_t kNumQuantizers = 4;

Tensor as_i64(const Tensor& indices) {
  return indices.dtype() == DType::i64 ? indices : indices.to(DType::i64);
}

// The seed FSQ and LFQ take (they key their projections and streams from it).
uint64_t layer_seed(uint64_t seed) {
  Generator gen = layer_generator(seed);
  return quant::draw_seed(gen);
}

quant::LFQOptions lfq_options(QuantizerOptions& c, int64_t dim, int64_t default_size,
                              uint64_t seed) {
  quant::LFQOptions o;
  o.dim = dim;
  o.codebook_size = option_int(c, "codebook_size", default_size);
  o.entropy_loss_weight = option_number(c, "entropy_loss_weight", o.entropy_loss_weight);
  o.commitment_loss_weight = option_number(c, "commitment_loss_weight", o.commitment_loss_weight);
  o.diversity_gamma = option_number(c, "diversity_gamma", o.diversity_gamma);
  o.seed = layer_seed(seed);
  return o;
}

// Single-layer FSQ and LFQ: indices [B, H, W] or [B, H, W, num_codebooks];
// the layers' indices_to_codes gives image-shaped indices back as
// [B, D, H, W].
template <class Layer>
class ScalarQuantizer : public StepKeyedQuantizer {
 public:
  ScalarQuantizer(std::shared_ptr<Layer> layer, std::string type, int64_t dim, uint64_t seed)
      : StepKeyedQuantizer(seed), type_(std::move(type)), dim_(dim), layer_(std::move(layer)) {}

  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, dim_, type_);
    quant::QuantizeOutput out = layer_->forward(z, Tensor());
    out.indices = as_i64(out.indices);
    return out;
  }
  Tensor decode(const Tensor& indices) override {
    return contiguous(layer_->indices_to_codes(as_i64(indices)));
  }
  int64_t codebook_size() const override { return layer_->codebook_size(); }
  int64_t num_codebooks() const override { return layer_->options().num_codebooks; }
  std::shared_ptr<Module> module() override { return layer_; }
  // LFQ's token means are cross-rank means under QuantizerSync.
  bool loss_is_global() const override { return std::is_same_v<Layer, quant::LFQ>; }

 private:
  std::string type_;
  int64_t dim_;
  std::shared_ptr<Layer> layer_;
};

// ResidualFSQ and ResidualLFQ: indices [B, H, W, num_quantizers]; quantize
// dropout decided by the adapter (keyed by the step, see StepKeyedQuantizer).
template <class Layer>
class ResidualScalarQuantizer : public StepKeyedQuantizer {
 public:
  ResidualScalarQuantizer(std::shared_ptr<Layer> layer, std::string type, int64_t dim,
                          int64_t codebook_size, bool dropout, uint64_t seed)
      : StepKeyedQuantizer(seed),
        type_(std::move(type)),
        dim_(dim),
        codebook_size_(codebook_size),
        dropout_(dropout),
        layer_(std::move(layer)) {}

  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, dim_, type_);
    const int64_t last = dropout_last_layer(dropout_, layer_->num_quantizers());
    quant::QuantizeOutput out = keep(z, last);
    out.indices = as_i64(out.indices);
    return out;
  }
  Tensor decode(const Tensor& indices) override {
    return channels_first(layer_->get_output_from_indices(as_i64(indices)));
  }
  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return layer_->num_quantizers(); }
  std::shared_ptr<Module> module() override { return layer_; }
  bool loss_is_global() const override { return std::is_same_v<Layer, quant::ResidualLFQ>; }

 private:
  quant::QuantizeOutput keep(const Tensor& z, int64_t last) {
    if constexpr (std::is_same_v<Layer, quant::ResidualLFQ>)
      return layer_->forward_keep(z, Tensor(), 0.0, last);
    else
      return layer_->forward_keep(z, Tensor(), last);
  }

  std::string type_;
  int64_t dim_, codebook_size_;
  bool dropout_;
  std::shared_ptr<Layer> layer_;
};

}  // namespace

std::unique_ptr<TrainQuantizer> make_scalar_family(const std::string& type, QuantizerOptions& c,
                                                   int64_t dim, uint64_t seed) {
  if (type == "fsq") {
    quant::FSQOptions o;
    o.levels = option_list(c, "levels", kLevels);
    o.dim = dim;
    o.num_codebooks = option_int(c, "num_codebooks", 1);
    o.seed = layer_seed(seed);
    return std::make_unique<ScalarQuantizer<quant::FSQ>>(std::make_shared<quant::FSQ>(o), type, dim,
                                                         seed);
  }
  if (type == "lfq") {
    const int64_t codebooks = option_int(c, "num_codebooks", 1);
    const int64_t bits = std::clamp<int64_t>(dim / codebooks, 1, kLfqMaxBits);
    quant::LFQOptions o = lfq_options(c, dim, int64_t{1} << bits, seed);
    o.num_codebooks = codebooks;
    return std::make_unique<ScalarQuantizer<quant::LFQ>>(std::make_shared<quant::LFQ>(o), type, dim,
                                                         seed);
  }
  if (type == "rfsq") {
    quant::ResidualFSQOptions o;
    o.fsq.levels = option_list(c, "levels", kLevels);
    o.fsq.dim = dim;
    o.fsq.seed = layer_seed(seed);
    o.num_quantizers = option_int(c, "num_quantizers", kNumQuantizers);
    o.quantize_dropout = option_bool(c, "quantize_dropout", false);
    auto layer = std::make_shared<quant::ResidualFSQ>(o);
    return std::make_unique<ResidualScalarQuantizer<quant::ResidualFSQ>>(
        layer, type, dim, layer->codebook_size(), o.quantize_dropout, seed);
  }
  if (type == "rlfq") {
    quant::ResidualLFQOptions o;
    o.lfq = lfq_options(c, dim, kRlfqCodebookSize, seed);
    o.num_quantizers = option_int(c, "num_quantizers", kNumQuantizers);
    o.quantize_dropout = option_bool(c, "quantize_dropout", false);
    auto layer = std::make_shared<quant::ResidualLFQ>(o);
    return std::make_unique<ResidualScalarQuantizer<quant::ResidualLFQ>>(
        layer, type, dim, o.lfq.codebook_size, o.quantize_dropout, seed);
  }
  return nullptr;
}

}  // namespace quanta::train::detail
