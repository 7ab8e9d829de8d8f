#include "quant/vq/rotation_trick.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/view.h"
#include "quant/vq/commitment_loss.h"

namespace quanta::quant {
namespace {

// The reference's safe_div clamps denominators at 1e-6; F.normalize (for w)
// at 1e-12.
constexpr double kSafe = 1e-6;
constexpr double kNormalizeEps = 1e-12;

// The commitment term of a row's input gradient: coef * w[r] * (x - q), with
// w the row weights (empty: every row 1) and coef = 2 dL/dcommit / elements.
template <class T>
struct CommitTerm {
  T coef = 0;
  const T* w = nullptr;  // null: every row counts
  T at(int64_t r) const { return w ? coef * w[r] : coef; }
};

// One row of x's gradient: lambda (g - 2 (g.w) w + 2 (g.q^) u) + cc (x - q),
// with u, q^, w and lambda recomputed from x and q (cheaper than saving
// them). A function of its own so the row pointers are locals (no closure
// loads in the loops) and the reductions run in SIMD lanes.
template <class T>
void rotate_row(const T* xr, const T* qr, const T* gr, T* out, int64_t d, T cc) {
  T xx = 0, qq = 0;
#pragma omp simd reduction(+ : xx, qq)
  for (int64_t e = 0; e < d; ++e) {
    xx += xr[e] * xr[e];
    qq += qr[e] * qr[e];
  }
  const T ix = T(1) / std::max<T>(std::sqrt(xx), T(kSafe));
  const T iq = T(1) / std::max<T>(std::sqrt(qq), T(kSafe));
  // |u + q^|^2, g.u and g.q^ in one pass (reciprocals: no divisions per element).
  T ww = 0, gu = 0, gq = 0;
#pragma omp simd reduction(+ : ww, gu, gq)
  for (int64_t e = 0; e < d; ++e) {
    const T u = xr[e] * ix, qh = qr[e] * iq;
    ww += (u + qh) * (u + qh);
    gu += gr[e] * u;
    gq += gr[e] * qh;
  }
  const T iw = T(1) / std::max<T>(std::sqrt(ww), T(kNormalizeEps));
  const T lambda = std::sqrt(qq) * ix;
  // g - 2 (g.w) w + 2 (g.q^) u with w = (u + q^) / |u + q^| and
  // g.w = (g.u + g.q^) / |u + q^|: coefficients per row, one fused pass.
  const T cw = T(2) * (gu + gq) * iw * iw;  // multiplies (u + q^)
  const T cu = T(2) * gq;                   // multiplies u
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) {
    const T u = xr[e] * ix, qh = qr[e] * iq;
    out[e] = lambda * (gr[e] - cw * (u + qh) + cu * u) + cc * (xr[e] - qr[e]);
  }
}

template <class T>
void rotate_backward(const T* x, const T* q, const T* g, T* gx, int64_t rows, int64_t d,
                     CommitTerm<T> commit) {
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(d, 1));
  cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      rotate_row(x + r * d, q + r * d, g + r * d, gx + r * d, d, commit.at(r));
  });
}

// One row of g + cc (x - q).
template <class T>
void straight_row(const T* xr, const T* qr, const T* gr, T* out, int64_t d, T cc) {
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) out[e] = gr[e] + cc * (xr[e] - qr[e]);
}

// g_x = g + the commitment term.
template <class T>
void straight_backward(const T* x, const T* q, const T* g, T* gx, int64_t rows, int64_t d,
                       CommitTerm<T> commit) {
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(d, 1));
  cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t o = r * d;
      straight_row(x + o, q + o, g + o, gx + o, d, commit.at(r));
    }
  });
}

void check_pair(const char* op, const Tensor& x, const Tensor& q) {
  detail::check_cpu(op, {&x, &q});
  if (x.shape() != q.shape() || x.dim() < 1)
    throw std::invalid_argument(std::string("[") + op +
                                "] x and q must have the same shape, got " +
                                shape_str(x.shape()) + " and " + shape_str(q.shape()));
  if (x.dtype() != q.dtype())
    throw std::invalid_argument(std::string("[") + op + "] x and q must share a dtype, got " +
                                dtype_name(x.dtype()) + " and " + dtype_name(q.dtype()));
}

// x's gradient from the output gradient `g` along `route`, plus the
// commitment term (coef 0: none).
Tensor input_gradient(const Tensor& xs, const Tensor& qd, const Tensor& g_out,
                      GradientRoute route, double coef, const Tensor& valid) {
  const int64_t d = xs.size(-1);
  const int64_t rows = d == 0 ? 0 : xs.numel() / d;
  const Tensor xc = contiguous(xs), qc = contiguous(qd), g = contiguous(g_out);
  Tensor gx = empty(xs.shape(), options_of(xs));  // every element is written
  dispatch_float(xs.dtype(), "rotate_to", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const std::vector<T> w = coef != 0 ? row_weights<T>(valid, rows) : std::vector<T>{};
    const CommitTerm<T> commit{T(coef), w.empty() ? nullptr : w.data()};
    auto* kernel = route == GradientRoute::rotation ? &rotate_backward<T> : &straight_backward<T>;
    kernel(xc.data<T>(), qc.data<T>(), g.data<T>(), gx.data<T>(), rows, d, commit);
  });
  return gx;
}

}  // namespace

Tensor rotate_to(const Tensor& x, const Tensor& q) {
  check_pair("rotate_to", x, q);
  const Tensor qd = q.detach();
  autograd::Function fn;
  fn.name = "rotate_to";
  // The value is q itself: R x = lambda |x| q^ = q, without the rounding of
  // evaluating the rotation (apply() hands out a fresh handle).
  fn.forward = [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[1]}; };
  fn.backward = [xs = x.detach(), qd](const std::vector<Tensor>& grads) {
    return std::vector<Tensor>{
        input_gradient(xs, qd, grads[0], GradientRoute::rotation, 0.0, Tensor()), Tensor()};
  };
  return autograd::apply(fn, {x, qd})[0];
}

TrainingOutput route_with_commitment(const Tensor& x, const Tensor& q, const Tensor& valid,
                                     GradientRoute route) {
  check_pair("route_with_commitment", x, q);
  detail::check_cpu("route_with_commitment", {&valid});
  const Tensor qd = q.detach();
  auto elements = std::make_shared<double>(0.0);  // the commitment's denominator
  autograd::Function fn;
  fn.name = route == GradientRoute::rotation ? "rotate_with_commitment"
                                             : "straight_through_with_commitment";
  fn.forward = [=](const std::vector<Tensor>& in) {
    const SquaredError e = masked_squared_error(in[0], in[1], valid);
    *elements = e.elements;
    const double commit = e.elements > 0 ? e.total / e.elements : 0.0;
    return std::vector<Tensor>{in[1], scalar(commit, options_of(in[0]))};
  };
  fn.backward = [=, xs = x.detach()](const std::vector<Tensor>& grads) {
    const double coef = *elements > 0 ? grads[1].item() * 2.0 / *elements : 0.0;
    return std::vector<Tensor>{input_gradient(xs, qd, grads[0], route, coef, valid), Tensor()};
  };
  const std::vector<Tensor> out = autograd::apply(fn, {x, qd});
  return {out[0], out[1]};
}

}  // namespace quanta::quant
