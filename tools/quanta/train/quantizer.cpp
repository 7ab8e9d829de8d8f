#include "train/quantizer.h"

#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "train/quantizer_config.h"

namespace quanta::train {

NoQuantizer::NoQuantizer() : module_(std::make_shared<Identity>()) {}

quant::QuantizeOutput NoQuantizer::forward(const Tensor& z) {
  if (z.dim() != 4)
    throw std::invalid_argument("[quantizer none] expected [B, D, H, W] features");
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
                                               uint64_t /*seed*/) {
  validate_quantizer_config(config);
  const std::string type = config.at("type").get<std::string>();
  if (dim <= 0)
    throw std::invalid_argument("[quantizer] feature dim must be positive, got " +
                                std::to_string(dim));
  if (type == "none") return std::make_unique<NoQuantizer>();
  // The layer families plug in here, one adapter each (config -> layer
  // options, forward on [B, D, H, W]).
  throw std::invalid_argument("[quantizer] '" + type +
                              "' is not available in this build yet (available: " +
                              available_quantizer_types() + ")");
}

}  // namespace quanta::train
