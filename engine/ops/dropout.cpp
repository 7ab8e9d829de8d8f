// Dropout: a random keep-mask scaled by 1 / (1 - p). The backward draws the
// same mask again from a copy of the generator taken before the forward's
// draw, or from the forward's own fill (philox is counter based: the same key
// and offset give the same words on every device), so no mask of values is
// kept between the passes (a QLoRA step of a 110M decoder kept 650 MB of
// them); dropout_linear keeps the mask as bits where the device's kernel
// writes them (1/32 of x in f32), so its backward draws nothing.
#include "engine/ops/dropout.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/random/sampling.h"

namespace quanta {
namespace {

// t times the keep-mask scaled by 1 / (1 - p) that a generator in a given
// state draws, in one pass (bernoulli_mul: no mask written): the forward
// draws from the caller's generator (advancing it), the backward again
// from a copy taken before.
struct MaskedBy {
  double p;
  Tensor operator()(const Tensor& t, Generator& g) const {
    return bernoulli_mul(t, 1.0 - p, 1.0 / (1.0 - p), g);
  }
};

void check_dropout(const Tensor& x, double p) {
  if (!x.defined()) throw std::invalid_argument("[dropout] undefined input");
  if (!(p >= 0 && p <= 1))
    throw std::invalid_argument("[dropout] p must be in [0, 1]: got " + std::to_string(p));
  if (!is_floating(x.dtype())) detail::bad_dtype("dropout", x.dtype(), "expected a floating dtype");
}

}  // namespace

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  check_dropout(x, p);
  if (!training || p == 0) return x;
  const TensorOptions opts{.dtype = x.dtype(), .device = x.device()};
  if (p == 1) return mul(x, zeros(x.shape(), opts));
  const Generator replay = gen;
  const MaskedBy masked{p};
  const Tensor out = masked(x, gen);  // advances gen as the draw does
  return autograd::record("dropout", out, {x}, [masked, replay](const Tensor& g) {
    Generator again = replay;
    return std::vector<Tensor>{masked(g, again)};
  });
}

Tensor dropout_linear(const Tensor& x, const Tensor& weight, double p, bool training,
                      Generator& gen, double scale) {
  check_dropout(x, p);
  if (!std::isfinite(scale))
    throw std::invalid_argument("[dropout_linear] scale must be finite: got " +
                                std::to_string(scale));
  const DType dt = x.dtype();
  if (!training || p == 0 || p == 1 || !weight.defined() || weight.dtype() != dt ||
      (dt != DType::f32 && dt != DType::f64) || weight.dim() != 2 || x.dim() < 1 ||
      x.numel() == 0 || weight.numel() == 0 || x.size(-1) != weight.size(1)) {
    const Tensor product = linear(dropout(x, p, training, gen), weight);
    return scale == 1.0 ? product : product * scale;
  }
  const Device device = common_device("dropout_linear", {&x, &weight});
  const Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t k = wc.size(1), r = wc.size(0), m = xc.numel() / k;
  // The mask is fixed by this fill (its stream taken once), so the backward
  // applies the same one without drawing from the generator again. Its
  // kept value carries the scale: (x m s) w^T, and the gradients' g w m s
  // and g^T (x m s), where a product scaled after would take a pass over
  // the output forward and one over its gradient backward.
  DropoutProduct d;
  d.mask = detail::taken_bernoulli_fill(xc.shape(), 1.0 - p, scale / (1.0 - p), dt, gen, device);
  d.m = m, d.k = k, d.r = r;
  Shape out_shape = x.shape();
  out_shape.back() = r;
  Tensor out = detail::make_tensor(out_shape, dt, device);
  d.x = xc.raw_data(), d.w = wc.raw_data(), d.t = out.raw_data();
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  // Where the device keeps the mask as bits (1/32 of x in f32), the backward
  // reads them instead of drawing the words again.
  Tensor bits;
  if (kernels(device).dropout_keeps_bits && autograd::any_requires_grad({x, weight})) {
    bits = detail::make_tensor({2 * m * keep_bit_words(k)}, DType::u8, device);
    d.keep_bits = static_cast<uint16_t*>(bits.raw_data());
  }
  kernels(device).dropout_product(d);
  return autograd::record(
      "dropout_linear", out, {x, weight},
      [x = need_w ? xc.detach() : Tensor(), w = need_x ? wc.detach() : Tensor(), bits,
       x_shape = x.shape(), mask = d.mask, m, k, r, dt, device, need_x, need_w](const Tensor& g) {
        // dx = (g w) * mask and dw = g^T (x * mask) over the rows, in one
        // kernel: x * mask is formed again, never stored.
        const Tensor gc = g.contiguous();
        DropoutProduct b;
        b.mask = mask;
        b.m = m, b.k = k, b.r = r;
        b.gt = gc.raw_data();
        if (bits.defined()) b.keep_bits = static_cast<uint16_t*>(bits.raw_data());
        Tensor gx, gw;
        if (need_x) {
          // Onto the sum of x's other gradients where the engine hands it over.
          const autograd::GradientBuffer buffer = autograd::gradient_buffer(0, x_shape, dt, device);
          gx = buffer.tensor;
          b.accumulate_gx = buffer.add;
          b.w = w.raw_data(), b.gx = gx.raw_data();
        }
        if (need_w) {
          gw = detail::make_tensor({r, k}, dt, device);
          b.x = x.raw_data(), b.gw = gw.raw_data();
        }
        kernels(device).dropout_product(b);
        return std::vector<Tensor>{gx, gw};
      });
}

}  // namespace quanta
