// Unary math and activations: forward kernel and backward formula together.
#include <cmath>
#include <limits>
#include <type_traits>

#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/op_helpers.h"

namespace quanta {
namespace {

using detail::one;
using detail::unary_float;

// Unary op whose backward needs the input x and/or the output y.
template <class Back>
Tensor with_grad(const char* op, const Tensor& x, Tensor y, Back back) {
  return autograd::record(op, y, {x}, [x = x.detach(), y = y.detach(), back](const Tensor& g) {
    return one(back(g, x, y));
  });
}

constexpr double kSqrt2OverPi = fn::detail::kSqrt2OverPi;

}  // namespace

Tensor neg(const Tensor& x) {
  Tensor y;
  if (is_floating(x.dtype())) {
    y = unary_float(UnaryOp::neg, x);
  } else {
    y = sub(shared_full({}, 0.0,
                        {.dtype = x.dtype() == DType::boolean ? DType::i64 : x.dtype(),
                         .device = x.device()}),
            x);
  }
  return with_grad("neg", x, y,
                   [](const Tensor& g, const Tensor&, const Tensor&) { return neg(g); });
}

Tensor abs(const Tensor& x) {
  if (!is_floating(x.dtype())) return where(lt(x, constant_like(x, 0)), neg(x), x);
  Tensor y = unary_float(UnaryOp::abs, x);
  return with_grad("abs", x, y,
                   [](const Tensor& g, const Tensor& x, const Tensor&) { return mul(g, sign(x)); });
}

Tensor exp(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::exp, x);
  return with_grad("exp", x, y,
                   [](const Tensor& g, const Tensor&, const Tensor& y) { return mul(g, y); });
}

Tensor log(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::log, x);
  return with_grad("log", x, y,
                   [](const Tensor& g, const Tensor& x, const Tensor&) { return div(g, x); });
}

Tensor log1p(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::log1p, x);
  return with_grad("log1p", x, y,
                   [](const Tensor& g, const Tensor& x, const Tensor&) { return div(g, x + 1.0); });
}

Tensor sqrt(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::sqrt, x);
  return with_grad("sqrt", x, y,
                   [](const Tensor& g, const Tensor&, const Tensor& y) { return div(g, y * 2.0); });
}

Tensor rsqrt(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::rsqrt, x);
  return with_grad("rsqrt", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, mul(pow(y, 3.0), constant_like(y, -0.5)));
  });
}

Tensor sin(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::sin, x);
  return with_grad("sin", x, y,
                   [](const Tensor& g, const Tensor& x, const Tensor&) { return mul(g, cos(x)); });
}

Tensor cos(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::cos, x);
  return with_grad("cos", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return neg(mul(g, sin(x)));
  });
}

Tensor tanh(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::tanh, x);
  return with_grad("tanh", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, 1.0 - square(y));
  });
}

Tensor erf(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::erf, x);
  return with_grad("erf", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    // d/dx erf(x) = 2/sqrt(pi) exp(-x^2)
    return mul(g, exp(neg(square(x))) * 1.1283791670955126);
  });
}

Tensor erfinv(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::erfinv, x);
  return with_grad("erfinv", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    // d/dx erfinv(x) = sqrt(pi)/2 exp(erfinv(x)^2)
    return mul(g, exp(square(y)) * 0.88622692545275801);
  });
}

Tensor atan(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::atan, x);
  return with_grad("atan", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return div(g, square(x) + 1.0);
  });
}

Tensor sigmoid(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::sigmoid, x);
  return with_grad("sigmoid", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, mul(y, 1.0 - y));
  });
}

Tensor relu(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::relu, x);
  return with_grad("relu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return relu_backward(g, x);
  });
}

Tensor leaky_relu(const Tensor& x, double slope) {
  Tensor y = unary_float(UnaryOp::leaky_relu, x, {slope});
  return with_grad("leaky_relu", x, y, [slope](const Tensor& g, const Tensor& x, const Tensor&) {
    return where(gt(x, constant_like(x, 0.0)), g, g * slope);
  });
}

Tensor gelu(const Tensor& x, GeluApprox approx) {
  if (approx == GeluApprox::tanh) {
    Tensor y = unary_float(UnaryOp::gelu_tanh, x);
    return with_grad("gelu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
      Tensor x2 = square(x);
      Tensor t = tanh((x + x2 * x * 0.044715) * kSqrt2OverPi);
      Tensor du = (1.0 + x2 * (3.0 * 0.044715)) * kSqrt2OverPi;
      Tensor d = (1.0 + t) * 0.5 + x * 0.5 * (1.0 - square(t)) * du;
      return mul(g, d);
    });
  }
  Tensor y = unary_float(UnaryOp::gelu, x);
  return with_grad("gelu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor cdf = unary_float(UnaryOp::gelu_backward, x);
    return mul(g, cdf);
  });
}

Tensor silu(const Tensor& x) {
  Tensor y = unary_float(UnaryOp::silu, x);
  return with_grad("silu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor s = sigmoid(x);
    return mul(g, s * (1.0 + x * (1.0 - s)));
  });
}

Tensor softplus(const Tensor& x, double beta, double threshold) {
  Tensor y = unary_float(UnaryOp::softplus, x, {beta, threshold});
  return with_grad("softplus", x, y,
                   [beta, threshold](const Tensor& g, const Tensor& x, const Tensor&) {
                     Tensor bx = x * beta;
                     return where(gt(bx, constant_like(bx, threshold)), g, mul(g, sigmoid(bx)));
                   });
}

Tensor square(const Tensor& x) {
  if (!is_floating(x.dtype())) return mul(x, x);
  Tensor y = unary_float(UnaryOp::square, x);
  return with_grad("square", x, y,
                   [](const Tensor& g, const Tensor& x, const Tensor&) { return mul(g, x * 2.0); });
}

Tensor clamp(const Tensor& x, double lo, double hi) {
  const bool has_lo = !std::isnan(lo), has_hi = !std::isnan(hi);
  Tensor y;
  if (is_floating(x.dtype())) {
    y = unary_float(UnaryOp::clamp, x, {lo, hi});
  } else {
    y = x;
    if (has_lo) y = maximum(y, constant_like(x, lo));
    if (has_hi) y = minimum(y, constant_like(x, hi));
    return y;
  }
  return with_grad("clamp", x, y, [=](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor keep;
    if (has_lo) keep = ge(x, constant_like(x, lo));
    if (has_hi) {
      const Tensor below = le(x, constant_like(x, hi));
      keep = keep.defined() ? logical_and(keep, below) : below;
    }
    return keep.defined() ? where(keep, g, constant_like(g, 0.0)) : g;
  });
}

Tensor clamp(const Tensor& x, const Tensor& lo, const Tensor& hi) {
  Tensor y = x;
  if (lo.defined()) y = maximum(y, lo);
  if (hi.defined()) y = minimum(y, hi);
  return y;
}

// ---- (nd) ----
namespace {
Tensor rounding(UnaryOp op, const Tensor& x) {
  if (!is_floating(x.dtype())) return x.detach().clone();
  return unary_float(op, x.detach());
}
}  // namespace

Tensor sign(const Tensor& x) {
  if (!is_floating(x.dtype()))
    return sub(gt(x, constant_like(x, 0)).to(x.dtype()), lt(x, constant_like(x, 0)).to(x.dtype()));
  return unary_float(UnaryOp::sign, x.detach());
}
Tensor round(const Tensor& x) { return rounding(UnaryOp::round, x); }
Tensor floor(const Tensor& x) { return rounding(UnaryOp::floor, x); }
Tensor ceil(const Tensor& x) { return rounding(UnaryOp::ceil, x); }

Tensor isnan(const Tensor& x) {
  if (!is_floating(x.dtype()))
    return zeros(x.shape(), {.dtype = DType::boolean, .device = x.device()});
  return ne(x.detach(), x.detach());
}

Tensor isfinite(const Tensor& x) {
  if (!is_floating(x.dtype()))
    return ones(x.shape(), {.dtype = DType::boolean, .device = x.device()});
  Tensor v = x.detach();
  return logical_and(eq(v, v), lt(abs(v), constant_like(v, INFINITY)));
}

}  // namespace quanta
