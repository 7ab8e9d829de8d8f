#include "quant/vq/rotation_trick.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "engine/autograd/function.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/view.h"

namespace quanta::quant {
namespace {

// The reference's safe_div clamps denominators at 1e-6; F.normalize (for w)
// at 1e-12.
constexpr double kSafe = 1e-6;
constexpr double kNormalizeEps = 1e-12;

// g_x = lambda (g - 2 (g.w) w + 2 (g.q^) u), one row of D at a time, with u,
// q^, w and lambda recomputed from x and q (cheaper than saving them).
template <class T>
void rotate_backward(const T* x, const T* q, const T* g, T* gx, int64_t rows, int64_t d) {
  const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(d, 1));
  cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * d;
      const T* qr = q + r * d;
      const T* gr = g + r * d;
      T* out = gx + r * d;
      T xx = 0, qq = 0;
      for (int64_t e = 0; e < d; ++e) xx += xr[e] * xr[e], qq += qr[e] * qr[e];
      const T xn = std::max<T>(std::sqrt(xx), T(kSafe));
      const T ix = T(1) / xn, iq = T(1) / std::max<T>(std::sqrt(qq), T(kSafe));
      // |u + q^|^2, g.u and g.q^ in one pass (reciprocals: no divisions per element).
      T ww = 0, gu = 0, gq = 0;
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
      for (int64_t e = 0; e < d; ++e) {
        const T u = xr[e] * ix, qh = qr[e] * iq;
        out[e] = lambda * (gr[e] - cw * (u + qh) + cu * u);
      }
    }
  });
}

}  // namespace

Tensor rotate_to(const Tensor& x, const Tensor& q) {
  detail::check_cpu("rotate_to", {&x, &q});
  if (x.shape() != q.shape() || x.dim() < 1)
    throw std::invalid_argument("[rotate_to] x and q must have the same shape, got " +
                                shape_str(x.shape()) + " and " + shape_str(q.shape()));
  if (x.dtype() != q.dtype())
    throw std::invalid_argument(std::string("[rotate_to] x and q must share a dtype, got ") +
                                dtype_name(x.dtype()) + " and " + dtype_name(q.dtype()));
  const Tensor qd = q.detach();
  autograd::Function fn;
  fn.name = "rotate_to";
  // The value is q itself: R x = lambda |x| q^ = q, without the rounding of
  // evaluating the rotation (apply() hands out a fresh handle).
  fn.forward = [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[1]}; };
  fn.backward = [xs = x.detach(), qd](const std::vector<Tensor>& grads) {
    const int64_t d = xs.size(-1);
    const int64_t rows = d == 0 ? 0 : xs.numel() / d;
    const Tensor xc = contiguous(xs), qc = contiguous(qd), g = contiguous(grads[0]);
    Tensor gx = empty(xs.shape(), options_of(xs));  // every element is written
    dispatch_float(xs.dtype(), "rotate_to", [&](auto tag) {
      using T = typename decltype(tag)::type;
      rotate_backward<T>(xc.data<T>(), qc.data<T>(), g.data<T>(), gx.data<T>(), rows, d);
    });
    return std::vector<Tensor>{gx, Tensor()};
  };
  return autograd::apply(fn, {x, qd})[0];
}

}  // namespace quanta::quant
