// Dropout: a random keep-mask scaled by 1 / (1 - p). The backward draws the
// same mask again from a copy of the generator taken before the forward's
// draw (philox is counter based: the same key and offset give the same
// words on every device), so no mask is kept between the passes: a QLoRA
// step of a 110M decoder kept 650 MB of them.
#include "engine/ops/dropout.h"

#include <stdexcept>
#include <string>
#include <tuple>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/ops/view.h"
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
  // a and b times the one mask the generator draws for a's shape (a
  // backward that applies it twice: one draw instead of two).
  std::pair<Tensor, Tensor> pair(const Tensor& a, const Tensor& b, Generator& g) const {
    return bernoulli_mul_pair(a, b, 1.0 - p, 1.0 / (1.0 - p), g);
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
                      Generator& gen) {
  check_dropout(x, p);
  if (!training || p == 0 || p == 1 || !weight.defined() || weight.dtype() != x.dtype() ||
      weight.dim() != 2 || !grad_enabled())
    return linear(dropout(x, p, training, gen), weight);
  const Generator replay = gen;
  const MaskedBy masked{p};
  Tensor out;
  {
    NoGradGuard no_grad;
    out = linear(masked(x, gen), weight);
  }
  // The gradients as linear's and dropout's backward form them: dx = (g w) *
  // mask, dw = g^T (x * mask) over the rows, each mask drawn again.
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  return autograd::record(
      "dropout_linear", out, {x, weight},
      [x = need_w ? x.detach() : Tensor(), w = need_x ? weight.detach() : Tensor(),
       x_shape = x.shape(), masked, replay, need_x, need_w](const Tensor& g) {
        // Both gradients read the mask: one draw masks the output gradient's
        // product and the input together (the bits of the fused draw either
        // way), no mask written.
        Generator again = replay;
        Tensor gx, gw, masked_x;
        if (need_x && need_w)
          std::tie(gx, masked_x) = masked.pair(matmul(g, w), x, again);
        else if (need_x)
          gx = masked(matmul(g, w), again);
        else
          masked_x = masked(x, again);
        if (need_w) {
          const int64_t out_f = g.size(-1), in_f = x_shape.back();
          const int64_t rows = numel_of(Shape(x_shape.begin(), x_shape.end() - 1));
          gw = matmul(transpose(reshape(g, {rows, out_f}), 0, 1), reshape(masked_x, {rows, in_f}));
        }
        return std::vector<Tensor>{gx, gw};
      });
}

}  // namespace quanta
