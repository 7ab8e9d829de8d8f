#include "quant/vq/directional_reparam.h"

#include <cmath>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "quant/vq/nearest_code.h"

namespace quanta::quant {

Tensor directional_reparam(const Tensor& x, const Tensor& q, double variance, const Tensor& noise) {
  if (x.shape() != q.shape())
    throw std::invalid_argument("[directional_reparam] x and q must have the same shape, got " +
                                shape_str(x.shape()) + " and " + shape_str(q.shape()));
  if (noise.defined() && noise.shape() != x.shape())
    throw std::invalid_argument("[directional_reparam] noise must have x's shape " +
                                shape_str(x.shape()) + ", got " + shape_str(noise.shape()));
  if (!(variance >= 0))
    throw std::invalid_argument("[directional_reparam] variance must be >= 0, got " +
                                std::to_string(variance));
  const Tensor error = q - x;
  Tensor direction;
  {
    NoGradGuard constant;
    direction = error.detach();
    if (noise.defined() && variance > 0)
      direction = direction + to_dtype(noise, x.dtype()) * std::sqrt(variance);
    direction = l2norm(direction);
  }
  return x + direction * norm(error, 2.0, {-1}, true);
}

}  // namespace quanta::quant
