#include "train/quantizer.h"

#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"
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

Tensor channels_first(const Tensor& y) { return contiguous(permute(y, {0, 3, 1, 2})); }

void check_features(const Tensor& z, int64_t dim, const std::string& type) {
  if (z.dim() != 4 || z.size(1) != dim)
    throw std::invalid_argument("[quantizer " + type + "] expected features [B, " +
                                std::to_string(dim) + ", H, W], got " + shape_str(z.shape()));
}

void StepKeyedQuantizer::set_group(dist::ProcessGroup& group) {
  sync_ = std::make_unique<quant::QuantizerSync>(module(), group);
  sync_->set_step(static_cast<uint64_t>(steps_));
}

quant::QuantizerSync& StepKeyedQuantizer::sync() {
  if (!sync_) {
    own_group_ = dist::ProcessGroup::single();
    set_group(*own_group_);
  }
  return *sync_;
}

void StepKeyedQuantizer::after_step() {
  sync().sync_state();
  ++steps_;
}

void StepKeyedQuantizer::load_extra_state(const nlohmann::json& state) {
  if (!state.contains("steps")) return;  // a checkpoint from before the count
  const nlohmann::json& s = state["steps"];
  if (!s.is_number_integer() || s.get<int64_t>() < 0)
    throw std::runtime_error("quantizer state: 'steps' must be an integer >= 0, got " + s.dump());
  steps_ = s.get<int64_t>();
  if (sync_) sync_->set_step(static_cast<uint64_t>(steps_));
}

int64_t StepKeyedQuantizer::dropout_last_layer(bool dropout, int64_t num_layers) {
  if (!dropout || num_layers <= 1 || !module()->is_training()) return -1;
  Generator gen = Generator::named(seed_, "quantize_dropout");
  gen.set_offset({0, static_cast<uint64_t>(steps_)});
  return randint(0, num_layers, {}, gen).item<int64_t>();
}

}  // namespace detail

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
