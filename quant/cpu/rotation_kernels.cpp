// CPU entry route_grad (quant/kernels/table.h): x's gradient through the
// rotation trick or straight through, plus the commitment term, in one fused
// pass per row. The per-element math is quant/kernels/functors.h's (the CUDA
// kernels' too).
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "quant/cpu/kernels.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cpu {
namespace {

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
  const fn::RotationNorms<T> nm = fn::rotation_norms(xx, qq);
  // |u + q^|^2, g.u and g.q^ in one pass (reciprocals: no divisions per element).
  T ww = 0, gu = 0, gq = 0;
#pragma omp simd reduction(+ : ww, gu, gq)
  for (int64_t e = 0; e < d; ++e) {
    const T u = xr[e] * nm.ix, qh = qr[e] * nm.iq;
    ww += (u + qh) * (u + qh);
    gu += gr[e] * u;
    gq += gr[e] * qh;
  }
  // g - 2 (g.w) w + 2 (g.q^) u with w = (u + q^) / |u + q^| and
  // g.w = (g.u + g.q^) / |u + q^|: coefficients per row, one fused pass.
  const fn::RotationCoeffs<T> cf = fn::rotation_coeffs(qq, nm, ww, gu, gq);
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) out[e] = fn::rotation_grad(xr[e], qr[e], gr[e], nm, cf, cc);
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
  for (int64_t e = 0; e < d; ++e) out[e] = fn::straight_grad(gr[e], cc, xr[e], qr[e]);
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

}  // namespace

void route_grad(bool rotation, DType dtype, const void* x, const void* q, const void* g,
                const uint8_t* valid, const double* coef, int64_t rows, int64_t d, void* gx) {
  dispatch_float(dtype, "rotate_to", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const double c = coef ? *coef : 0.0;
    const std::vector<T> w = c != 0 ? row_weights<T>(valid, rows) : std::vector<T>{};
    const CommitTerm<T> commit{T(c), w.empty() ? nullptr : w.data()};
    auto* kernel = rotation ? &rotate_backward<T> : &straight_backward<T>;
    kernel(static_cast<const T*>(x), static_cast<const T*>(q), static_cast<const T*>(g),
           static_cast<T*>(gx), rows, d, commit);
  });
}

}  // namespace quanta::quant::quant_cpu
