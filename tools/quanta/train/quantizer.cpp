#include "train/quantizer.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "engine/capture/device_graph.h"
#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/view.h"
#include "quant/grouped.h"
#include "quant/residual.h"
#include "quant/scalar/lfq.h"
#include "quant/step_stream.h"
#include "quant/vq/vector_quantize.h"
#include "train/quantizer_adapter.h"
#include "train/quantizer_config.h"

namespace quanta::train {

namespace detail {

void QuantizerOptions::record(const std::string& key, const nlohmann::json& value) {
  if (!given_.contains(key)) resolved_[key] = value;
}

int64_t option_int(QuantizerOptions& config, const std::string& key, int64_t fallback) {
  if (fallback != 0) config.record(key, fallback);
  return config.given().contains(key) ? config.given()[key].get<int64_t>() : fallback;
}

double option_number(QuantizerOptions& config, const std::string& key, double fallback) {
  config.record(key, fallback);
  return config.given().contains(key) ? config.given()[key].get<double>() : fallback;
}

bool option_bool(QuantizerOptions& config, const std::string& key, bool fallback) {
  config.record(key, fallback);
  return config.given().contains(key) ? config.given()[key].get<bool>() : fallback;
}

std::vector<int64_t> option_list(QuantizerOptions& config, const std::string& key,
                                 const std::vector<int64_t>& fallback) {
  config.record(key, fallback);
  return config.given().contains(key) ? config.given()[key].get<std::vector<int64_t>>() : fallback;
}

Generator layer_generator(uint64_t seed) { return Generator::named(seed, "quantizer"); }

namespace {

Tensor as_i64(const Tensor& indices) {
  return indices.dtype() == DType::i64 ? indices : indices.to(DType::i64);
}

// [B, H, W, D] (a layer's channel-last output) to [B, D, H, W].
Tensor channels_first(const Tensor& y) { return contiguous(permute(y, {0, 3, 1, 2})); }

}  // namespace

LayerQuantizer::LayerQuantizer(std::shared_ptr<quant::Quantizer> layer, std::string type,
                               int64_t dim, uint64_t seed)
    : layer_(std::move(layer)), type_(std::move(type)), dim_(dim) {
  if (auto* g = dynamic_cast<quant::Grouped*>(layer_.get())) groups_ = g->groups();
  for (auto& [path, m] : layer_->named_modules())
    loss_is_global_ = loss_is_global_ || dynamic_cast<quant::LFQ*>(m) != nullptr;
  // The dropout draw of step s is the run seed's stream "quantize_dropout"
  // at offset {0, s}, as it has been since the command had one: checkpoints
  // resume onto the same draws. (Grouped layers decide by group 0's stream.)
  for (auto& [path, m] : layer_->named_modules())
    if (auto* r = dynamic_cast<quant::Residual*>(m))
      r->seed_dropout(Generator::named(seed, "quantize_dropout"));
  pin_streams();
}

void check_features(const Tensor& z, const std::string& type, int64_t dim) {
  if (z.dim() != 4 || z.size(1) != dim)
    throw std::invalid_argument("[quantizer " + type + "] expected features [B, " +
                                std::to_string(dim) + ", H, W], got " + shape_str(z.shape()));
}

quant::QuantizeOutput LayerQuantizer::forward(const Tensor& z) {
  check_features(z, type_, dim_);
  quant::QuantizeOutput out = layer_->forward(z, Tensor(), {});
  out.indices = as_i64(out.indices);
  if (groups_ > 0) {  // [G, B, H, W, Q] -> [B, H, W, G * Q]
    const Tensor& i = out.indices;
    out.indices = reshape(contiguous(permute(i, {1, 2, 3, 0, 4})),
                          {i.size(1), i.size(2), i.size(3), num_codebooks()});
  }
  return out;
}

Tensor LayerQuantizer::decode(const Tensor& indices) {
  Tensor idx = as_i64(indices);
  if (groups_ > 0) {  // [B, H, W, G * Q] -> [G, B, H, W, Q]
    if (idx.dim() != 4 || idx.size(3) != num_codebooks())
      throw std::invalid_argument("[quantizer " + type_ + "] expected indices [B, H, W, " +
                                  std::to_string(num_codebooks()) + "], got " +
                                  shape_str(idx.shape()));
    const Tensor split =
        reshape(idx, {idx.size(0), idx.size(1), idx.size(2), groups_, num_codebooks() / groups_});
    idx = contiguous(permute(split, {3, 0, 1, 2, 4}));
  }
  return channels_first(layer_->get_output_from_indices(idx));
}

std::string LayerQuantizer::codebook_name(int64_t i) const {
  if (groups_ > 0) {
    const int64_t levels = num_codebooks() / groups_;
    return "group " + std::to_string(i / levels) + " level " + std::to_string(i % levels);
  }
  if (dynamic_cast<const quant::Residual*>(layer_.get())) return "level " + std::to_string(i);
  if (dynamic_cast<const quant::VectorQuantize*>(layer_.get())) return "head " + std::to_string(i);
  return TrainQuantizer::codebook_name(i);
}

void SyncedQuantizer::pin_streams() {
  for (auto& [path, m] : module()->named_modules())
    if (auto* s = dynamic_cast<quant::StepKeyed*>(m)) s->pin_random_step(uint64_t(steps_));
}

void SyncedQuantizer::set_group(dist::ProcessGroup& group) {
  sync_ = std::make_unique<quant::QuantizerSync>(module(), group);
  sync_->set_step(static_cast<uint64_t>(steps_));
}

quant::QuantizerSync& SyncedQuantizer::sync() {
  if (!sync_) {
    own_group_ = dist::ProcessGroup::single();
    set_group(*own_group_);
  }
  return *sync_;
}

void SyncedQuantizer::after_step() {
  sync().sync_state();
  ++steps_;
  on_replay([this] { ++steps_; });  // in a captured step: each replay is a step
}

void SyncedQuantizer::load_extra_state(const nlohmann::json& state) {
  if (!state.contains("steps")) return;  // a checkpoint from before the count
  const nlohmann::json& s = state["steps"];
  if (!s.is_number_integer() || s.get<int64_t>() < 0)
    throw std::runtime_error("quantizer state: 'steps' must be an integer >= 0, got " + s.dump());
  steps_ = s.get<int64_t>();
  if (sync_)
    sync_->set_step(static_cast<uint64_t>(steps_));
  else
    pin_streams();
}

}  // namespace detail

std::vector<Tensor> TrainQuantizer::codes_per_codebook(const Tensor& indices) const {
  const int64_t q = num_codebooks();
  if (q == 1) return {indices};
  if (indices.dim() == 0 || indices.size(-1) != q)
    throw std::invalid_argument("[metrics] indices " + shape_str(indices.shape()) +
                                " lack the trailing dimension of " + std::to_string(q) +
                                " codebooks");
  std::vector<Tensor> codes;
  for (int64_t i = 0; i < q; ++i) codes.push_back(select(indices, -1, i));
  return codes;
}

NoQuantizer::NoQuantizer() : module_(std::make_shared<Identity>()) {}

quant::QuantizeOutput NoQuantizer::forward(const Tensor& z) {
  if (z.dim() != 4) throw std::invalid_argument("[quantizer none] expected [B, D, H, W] features");
  quant::QuantizeOutput out;
  out.quantized = z;
  out.indices = zeros({0}, {.dtype = DType::i64});
  out.loss = zeros({}, options_of(z));
  return out;
}

Tensor NoQuantizer::decode(const Tensor&) {
  throw std::invalid_argument(
      "[quantizer none] has no codes to decode: train with a real quantizer "
      "(--quantizer vq, fsq, lfq, ...)");
}

namespace {

// make_quantizer, reading the options through `options`.
std::unique_ptr<TrainQuantizer> build(detail::QuantizerOptions& options, int64_t dim,
                                      uint64_t seed) {
  const nlohmann::json& config = options.given();
  validate_quantizer_config(config);
  const std::string type = config.at("type").get<std::string>();
  if (dim <= 0)
    throw std::invalid_argument("[quantizer] feature dim must be positive, got " +
                                std::to_string(dim));
  if (type == "none") return std::make_unique<NoQuantizer>();
  if (auto q = detail::make_vq_family(type, options, dim, seed)) return q;
  if (auto q = detail::make_scalar_family(type, options, dim, seed)) return q;
  if (auto q = detail::make_hierarchical(type, options, dim, seed)) return q;
  throw std::invalid_argument("[quantizer] '" + type + "' is not available (available: " +
                              available_quantizer_types() + ")");
}

}  // namespace

std::unique_ptr<TrainQuantizer> make_quantizer(const nlohmann::json& config, int64_t dim,
                                               uint64_t seed) {
  detail::QuantizerOptions options(config);
  return build(options, dim, seed);
}

nlohmann::json resolved_quantizer_config(const nlohmann::json& config, int64_t dim) {
  // The adapters record each default as they read it: building the layer
  // (small: codebooks of a few thousand floats) is the one way to know them.
  detail::QuantizerOptions options(config);
  build(options, dim, 0);
  return options.resolved();
}

}  // namespace quanta::train
