#include "quant/quantize_dropout.h"

#include <algorithm>
#include <stdexcept>

#include "engine/random/sampling.h"

namespace quanta::quant {

void QuantizeDropout::check(const std::string& who, int64_t num_layers) const {
  if (multiple_of < 1) {
    std::string m = "[" + who + "] quantize_dropout_multiple_of must be >= 1, got ";
    m += std::to_string(multiple_of);
    throw std::invalid_argument(m);
  }
  if (cutoff_index < 0 || (enabled && cutoff_index >= num_layers)) {
    std::string m = "[" + who + "] quantize_dropout_cutoff_index must lie in [0, ";
    m += std::to_string(num_layers);
    m += "), got ";
    m += std::to_string(cutoff_index);
    throw std::invalid_argument(m);
  }
}

int64_t QuantizeDropout::draw(Generator& gen, int64_t num_layers) const {
  int64_t k = randint(cutoff_index, num_layers, {}, gen).item<int64_t>();
  if (multiple_of > 1) k = ((k + multiple_of) / multiple_of) * multiple_of - 1;
  return std::min(k, num_layers - 1);
}

}  // namespace quanta::quant
