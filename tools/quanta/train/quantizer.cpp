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

int64_t option_int(const nlohmann::json& config, const std::string& key, int64_t fallback) {
  return config.contains(key) ? config[key].get<int64_t>() : fallback;
}

double option_number(const nlohmann::json& config, const std::string& key, double fallback) {
  return config.contains(key) ? config[key].get<double>() : fallback;
}

bool option_bool(const nlohmann::json& config, const std::string& key, bool fallback) {
  return config.contains(key) ? config[key].get<bool>() : fallback;
}

std::vector<int64_t> option_list(const nlohmann::json& config, const std::string& key,
                                 const std::vector<int64_t>& fallback) {
  return config.contains(key) ? config[key].get<std::vector<int64_t>>() : fallback;
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

std::unique_ptr<TrainQuantizer> make_quantizer(const nlohmann::json& config, int64_t dim,
                                               uint64_t seed) {
  validate_quantizer_config(config);
  const std::string type = config.at("type").get<std::string>();
  if (dim <= 0)
    throw std::invalid_argument("[quantizer] feature dim must be positive, got " +
                                std::to_string(dim));
  if (type == "none") return std::make_unique<NoQuantizer>();
  if (auto q = detail::make_vq_family(type, config, dim, seed)) return q;
  if (auto q = detail::make_scalar_family(type, config, dim, seed)) return q;
  throw std::invalid_argument("[quantizer] '" + type + "' is not available (available: " +
                              available_quantizer_types() + ")");
}

}  // namespace quanta::train
