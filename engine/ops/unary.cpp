// Unary math and activations: forward kernel and backward formula together.
#include <cmath>
#include <limits>
#include <type_traits>

#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/elementwise_kernels.h"

namespace quanta {
namespace {

using detail::unary_float;
std::vector<Tensor> one(Tensor g) { return {std::move(g)}; }

// Unary op whose backward needs the input x and/or the output y.
template <class Back>
Tensor with_grad(const char* op, const Tensor& x, Tensor y, Back back) {
  return autograd::record(op, y, {x}, [x = x.detach(), y = y.detach(), back](const Tensor& g) {
    return one(back(g, x, y));
  });
}

constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;

}  // namespace

Tensor neg(const Tensor& x) {
  detail::check_cpu("neg", {&x});
  Tensor y;
  if (is_floating(x.dtype())) {
    y = unary_float("neg", x, [](auto v) { return -v; });
  } else {
    y = sub(scalar(0.0, {.dtype = x.dtype() == DType::boolean ? DType::i64 : x.dtype()}), x);
  }
  return with_grad("neg", x, y, [](const Tensor& g, const Tensor&, const Tensor&) { return neg(g); });
}

Tensor abs(const Tensor& x) {
  if (!is_floating(x.dtype())) return where(lt(x, scalar_like(x, 0)), neg(x), x);
  Tensor y = unary_float("abs", x, [](auto v) { return std::abs(v); },
                         [](const auto& a) { return a.abs(); });
  return with_grad("abs", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return mul(g, sign(x));
  });
}

Tensor exp(const Tensor& x) {
  Tensor y = unary_float(
      "exp", x, [](auto v) { return std::exp(v); }, [](const auto& a) { return a.exp(); },
      [](const auto* src, auto* dst, int64_t n) {
        // Eigen's SSE2 double exp clamps its input, so exp(-inf) came out as
        // 5.6e-309 instead of 0 (a -inf logit got a sliver of probability).
        // Below log(denorm_min) the true result is 0 in every precision.
        using T = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
        const T underflow = std::log(std::numeric_limits<T>::denorm_min());
        // A select, not a branch: the compiler turns it into a vector blend.
        for (int64_t i = 0; i < n; ++i) dst[i] = src[i] < underflow ? T(0) : dst[i];
      });
  return with_grad("exp", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, y);
  });
}

Tensor log(const Tensor& x) {
  Tensor y = unary_float("log", x, [](auto v) { return std::log(v); },
                         [](const auto& a) { return a.log(); });
  return with_grad("log", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return div(g, x);
  });
}

Tensor log1p(const Tensor& x) {
  Tensor y = unary_float("log1p", x, [](auto v) { return std::log1p(v); },
                         [](const auto& a) { return a.log1p(); });
  return with_grad("log1p", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return div(g, x + 1.0);
  });
}

Tensor sqrt(const Tensor& x) {
  Tensor y = unary_float("sqrt", x, [](auto v) { return std::sqrt(v); },
                         [](const auto& a) { return a.sqrt(); });
  return with_grad("sqrt", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return div(g, y * 2.0);
  });
}

Tensor rsqrt(const Tensor& x) {
  Tensor y = unary_float("rsqrt", x, [](auto v) { return decltype(v)(1) / std::sqrt(v); },
                         [](const auto& a) { return a.rsqrt(); });
  return with_grad("rsqrt", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, mul(pow(y, 3.0), scalar_like(y, -0.5)));
  });
}

Tensor sin(const Tensor& x) {
  Tensor y = unary_float("sin", x, [](auto v) { return std::sin(v); },
                         [](const auto& a) { return a.sin(); });
  return with_grad("sin", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return mul(g, cos(x));
  });
}

Tensor cos(const Tensor& x) {
  Tensor y = unary_float("cos", x, [](auto v) { return std::cos(v); },
                         [](const auto& a) { return a.cos(); });
  return with_grad("cos", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return neg(mul(g, sin(x)));
  });
}

Tensor tanh(const Tensor& x) {
  Tensor y = unary_float("tanh", x, [](auto v) { return std::tanh(v); },
                         [](const auto& a) { return a.tanh(); });
  return with_grad("tanh", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, 1.0 - square(y));
  });
}

Tensor sigmoid(const Tensor& x) {
  Tensor y = unary_float("sigmoid", x, [](auto v) {
    using T = decltype(v);
    // Stable for large |v|: never exponentiate a large positive number.
    return v >= 0 ? T(1) / (T(1) + std::exp(-v)) : std::exp(v) / (T(1) + std::exp(v));
  });
  return with_grad("sigmoid", x, y, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, mul(y, 1.0 - y));
  });
}

Tensor relu(const Tensor& x) {
  Tensor y = unary_float("relu", x, [](auto v) { return v > 0 ? v : decltype(v)(0); });
  return with_grad("relu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return where(gt(x, scalar_like(x, 0.0)), g, scalar_like(g, 0.0));
  });
}

Tensor leaky_relu(const Tensor& x, double slope) {
  Tensor y = unary_float("leaky_relu", x, [slope](auto v) {
    return v > 0 ? v : static_cast<decltype(v)>(slope) * v;
  });
  return with_grad("leaky_relu", x, y, [slope](const Tensor& g, const Tensor& x, const Tensor&) {
    return where(gt(x, scalar_like(x, 0.0)), g, g * slope);
  });
}

Tensor gelu(const Tensor& x, GeluApprox approx) {
  if (approx == GeluApprox::tanh) {
    Tensor y = unary_float("gelu", x, [](auto v) {
      using T = decltype(v);
      const T u = T(kSqrt2OverPi) * (v + T(0.044715) * v * v * v);
      return T(0.5) * v * (T(1) + std::tanh(u));
    });
    return with_grad("gelu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
      Tensor x2 = square(x);
      Tensor t = tanh((x + x2 * x * 0.044715) * kSqrt2OverPi);
      Tensor du = (1.0 + x2 * (3.0 * 0.044715)) * kSqrt2OverPi;
      Tensor d = (1.0 + t) * 0.5 + x * 0.5 * (1.0 - square(t)) * du;
      return mul(g, d);
    });
  }
  Tensor y = unary_float("gelu", x, [](auto v) {
    using T = decltype(v);
    return T(0.5) * v * (T(1) + std::erf(v * T(kInvSqrt2)));
  });
  return with_grad("gelu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor cdf = unary_float("gelu_backward", x, [](auto v) {
      using T = decltype(v);
      return T(0.5) * (T(1) + std::erf(v * T(kInvSqrt2))) +
             v * T(kInvSqrt2Pi) * std::exp(T(-0.5) * v * v);
    });
    return mul(g, cdf);
  });
}

Tensor silu(const Tensor& x) {
  Tensor y = unary_float("silu", x, [](auto v) {
    using T = decltype(v);
    return v / (T(1) + std::exp(-v));
  });
  return with_grad("silu", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor s = sigmoid(x);
    return mul(g, s * (1.0 + x * (1.0 - s)));
  });
}

Tensor softplus(const Tensor& x, double beta, double threshold) {
  Tensor y = unary_float("softplus", x, [beta, threshold](auto v) {
    using T = decltype(v);
    const T bx = T(beta) * v;
    return bx > T(threshold) ? v : std::log1p(std::exp(bx)) / T(beta);
  });
  return with_grad("softplus", x, y, [beta, threshold](const Tensor& g, const Tensor& x,
                                                       const Tensor&) {
    Tensor bx = x * beta;
    return where(gt(bx, scalar_like(bx, threshold)), g, mul(g, sigmoid(bx)));
  });
}

Tensor square(const Tensor& x) {
  if (!is_floating(x.dtype())) return mul(x, x);
  Tensor y = unary_float("square", x, [](auto v) { return v * v; });
  return with_grad("square", x, y, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return mul(g, x * 2.0);
  });
}

Tensor clamp(const Tensor& x, double lo, double hi) {
  const bool has_lo = !std::isnan(lo), has_hi = !std::isnan(hi);
  Tensor y;
  if (is_floating(x.dtype())) {
    y = unary_float("clamp", x, [=](auto v) {
      using T = decltype(v);
      if (v != v) return v;
      if (has_lo && v < T(lo)) v = T(lo);
      if (has_hi && v > T(hi)) v = T(hi);
      return v;
    });
  } else {
    y = x;
    if (has_lo) y = maximum(y, scalar_like(x, lo));
    if (has_hi) y = minimum(y, scalar_like(x, hi));
    return y;
  }
  return with_grad("clamp", x, y, [=](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor keep = ones(x.shape(), {.dtype = DType::boolean});
    if (has_lo) keep = logical_and(keep, ge(x, scalar_like(x, lo)));
    if (has_hi) keep = logical_and(keep, le(x, scalar_like(x, hi)));
    return where(keep, g, scalar_like(g, 0.0));
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
template <class F>
Tensor rounding(const char* op, const Tensor& x, F f) {
  if (!is_floating(x.dtype())) return x.detach().clone();
  return unary_float(op, x.detach(), f);
}
}  // namespace

Tensor sign(const Tensor& x) {
  if (!is_floating(x.dtype()))
    return sub(gt(x, scalar_like(x, 0)).to(x.dtype()), lt(x, scalar_like(x, 0)).to(x.dtype()));
  return unary_float("sign", x.detach(), [](auto v) {
    using T = decltype(v);
    return v > 0 ? T(1) : (v < 0 ? T(-1) : v);  // keeps 0 and NaN
  });
}
Tensor round(const Tensor& x) {
  return rounding("round", x, [](auto v) { return std::nearbyint(v); });
}
Tensor floor(const Tensor& x) {
  return rounding("floor", x, [](auto v) { return std::floor(v); });
}
Tensor ceil(const Tensor& x) {
  return rounding("ceil", x, [](auto v) { return std::ceil(v); });
}

Tensor isnan(const Tensor& x) {
  if (!is_floating(x.dtype())) return zeros(x.shape(), {.dtype = DType::boolean});
  return ne(x.detach(), x.detach());
}

Tensor isfinite(const Tensor& x) {
  if (!is_floating(x.dtype())) return ones(x.shape(), {.dtype = DType::boolean});
  Tensor v = x.detach();
  return logical_and(eq(v, v), lt(abs(v), scalar_like(v, INFINITY)));
}

}  // namespace quanta
