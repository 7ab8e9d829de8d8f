#include "quant/nf4/loftq.h"

#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/svd.h"
#include "engine/ops/view.h"

namespace quanta::quant {

std::vector<QuantizationErrorChange> loftq_init(
    const std::vector<std::pair<LoRALinear*, Tensor>>& layers) {
  NoGradGuard no_grad;
  std::vector<Tensor> errors;
  std::vector<int64_t> ranks;
  for (const auto& [layer, weight] : layers) {
    const NF4Linear& base = *layer->base();
    const Shape shape{base.out_features(), base.in_features()};
    if (weight.shape() != shape)
      throw std::invalid_argument("[loftq_init] the float weight is " + shape_str(weight.shape()) +
                                  ", the layer's base " + shape_str(shape));
    const DType dtype = weight.dtype() == DType::f64 ? DType::f64 : DType::f32;
    const Device host = Device::cpu();
    const Tensor quantized = base.dequantized_weight(layer->base_dtype()).to(host).to(dtype);
    errors.push_back(weight.to(host).to(dtype) - quantized);
    ranks.push_back(layer->lora_A().shape()[0]);
  }
  const std::vector<SingularTriplets> svds = top_singular_triplets(errors, ranks);
  std::vector<QuantizationErrorChange> out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    LoRALinear& layer = *layers[i].first;
    const SingularTriplets& t = svds[i];
    // sqrt(S / scaling) on both factors: scaling B A = U S Vh.
    const Tensor root = sqrt(t.s / layer.scaling());
    layer.set_adapters(unsqueeze(root, 1) * t.vh, t.u * unsqueeze(root, 0));
    out.push_back({t.total_square, t.rest_square});
  }
  return out;
}

QuantizationErrorChange loftq_init(LoRALinear& layer, const Tensor& weight) {
  return loftq_init({{&layer, weight}})[0];
}

}  // namespace quanta::quant
