// Dropout: a random keep-mask scaled by 1 / (1 - p), applied with `mul` so the
// backward (g * mask / (1 - p)) comes from mul's rule on every device.
#include "engine/ops/dropout.h"

#include <stdexcept>
#include <string>

#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/random/sampling.h"

namespace quanta {

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  if (!x.defined()) throw std::invalid_argument("[dropout] undefined input");
  if (!(p >= 0 && p <= 1))
    throw std::invalid_argument("[dropout] p must be in [0, 1]: got " + std::to_string(p));
  if (!is_floating(x.dtype())) detail::bad_dtype("dropout", x.dtype(), "expected a floating dtype");
  if (!training || p == 0) return x;
  const TensorOptions opts{.dtype = x.dtype(), .device = x.device()};
  if (p == 1) return mul(x, zeros(x.shape(), opts));
  Tensor keep = bernoulli(x.shape(), 1.0 - p, gen, opts);
  return mul(x, keep * (1.0 / (1.0 - p)));
}

}  // namespace quanta
