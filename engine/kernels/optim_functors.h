#pragma once
// The per-element updates of SGD and Adam/AdamW, written once for g++ and
// nvcc (QUANTA_HD): both kernel tables run one fused pass per parameter with
// them, and the results equal, bit for bit, the chain of single-op kernels
// they replace (engine/optim/optimizer.cpp keeps the chain for what the
// fused step does not take: 16-bit or non-contiguous parameters). One
// exception: the CPU's sqrt kernel is Eigen's vector form, which with
// EIGEN_FAST_MATH is not correctly rounded, so the CPU's Adam step runs
// moments(), that same sqrt kernel, then apply(); the device, whose sqrt
// kernel rounds correctly, runs all three in one pass.
//
// Bit equality means rounding where the chain rounds. The chain's
// `d + a * x` kernels (add_, addcmul_) are contracted to a fused
// multiply-add by nvcc and by g++ on targets with FMA (quanta's default
// -march=native on x86): mul_add says so explicitly. Every other step rounds
// on its own: the device uses the _rn intrinsics (which nvcc never fuses),
// and on the host no plain product meets a plain add (add_rounded keeps a
// fresh product from being fused into the add that follows it).
#include <cmath>
#include <cstdint>

#include "engine/kernels/functors.h"
#include "engine/kernels/table.h"  // SgdStep, AdamStep

namespace quanta {

namespace fn {

// ---- rounding-exact arithmetic ----
enum class RoundedOp { mul, add, sub, div };

/** a op b rounded once and never contracted with a neighbour: the device's
 * _rn intrinsic of T (f32 or f64), the host's plain operator. */
template <RoundedOp Op, class T>
QUANTA_HD inline T rounded(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    if constexpr (Op == RoundedOp::mul) return __fmul_rn(a, b);
    if constexpr (Op == RoundedOp::add) return __fadd_rn(a, b);
    if constexpr (Op == RoundedOp::sub) return __fsub_rn(a, b);
    if constexpr (Op == RoundedOp::div) return __fdiv_rn(a, b);
  } else {
    if constexpr (Op == RoundedOp::mul) return __dmul_rn(a, b);
    if constexpr (Op == RoundedOp::add) return __dadd_rn(a, b);
    if constexpr (Op == RoundedOp::sub) return __dsub_rn(a, b);
    if constexpr (Op == RoundedOp::div) return __ddiv_rn(a, b);
  }
#else
  if constexpr (Op == RoundedOp::mul) return a * b;
  if constexpr (Op == RoundedOp::add) return a + b;
  if constexpr (Op == RoundedOp::sub) return a - b;
  if constexpr (Op == RoundedOp::div) return a / b;
#endif
}
template <class T>
QUANTA_HD inline T mul_rn(T a, T b) {
  return rounded<RoundedOp::mul>(a, b);
}
template <class T>
QUANTA_HD inline T add_rn(T a, T b) {
  return rounded<RoundedOp::add>(a, b);
}
template <class T>
QUANTA_HD inline T sub_rn(T a, T b) {
  return rounded<RoundedOp::sub>(a, b);
}
template <class T>
QUANTA_HD inline T div_rn(T a, T b) {
  return rounded<RoundedOp::div>(a, b);
}
template <class T>
QUANTA_HD inline T sqrt_rn(T a) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4)
    return __fsqrt_rn(a);
  else
    return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
/** d + a x as the single-op kernels compute it: one rounding where the
 * compiler contracts it (nvcc; g++ with FMA), two elsewhere. */
template <class T>
QUANTA_HD inline T mul_add(T a, T x, T d) {
#if defined(__CUDA_ARCH__) || defined(__FMA__)
  return std::fma(a, x, d);
#else
  return d + a * x;
#endif
}
/** x + y, rounded once, where x may be a product that the chain rounded
 * before adding (an fma with multiplier 1 is exactly x + y, and g++ does
 * not fuse a product into an fma's multiplicand). */
template <class T>
QUANTA_HD inline T add_rounded(T x, T y) {
#if defined(__CUDA_ARCH__)
  return add_rn(x, y);
#elif defined(__FMA__)
  return std::fma(T(1), x, y);
#else
  return x + y;
#endif
}

/** SGD with momentum, dampening, nesterov and (L2) weight decay, as
 * optimizer.cpp's chain: d = g + wd p; buf = buf mom + (1 - damp) d (or d
 * when new); d = nesterov ? d + mom buf : buf; p = p - lr d. */
template <class T>
struct SgdUpdate {
  T wd, momentum, keep, neg_lr;
  bool has_wd, has_momentum, nesterov, first;

  /** From settings whose `live` values (SgdStep::live) were read. */
  QUANTA_HD explicit SgdUpdate(const SgdStep& s)
      : wd(static_cast<T>(s.weight_decay)),
        momentum(static_cast<T>(s.momentum)),
        keep(static_cast<T>(sub_rn(1.0, s.dampening))),
        neg_lr(static_cast<T>(-s.lr)),
        has_wd(s.weight_decay != 0),
        has_momentum(s.momentum != 0),
        nesterov(s.nesterov),
        first(s.first) {}

  QUANTA_HD void operator()(T& p, T g, T* buf) const {
    T d = has_wd ? mul_add(wd, p, g) : g;
    if (has_momentum) {
      const T b = first ? d : mul_add(keep, d, mul_rn(*buf, momentum));
      *buf = b;
      d = nesterov ? mul_add(momentum, b, d) : b;
    }
    p = mul_add(neg_lr, d, p);
  }
};

/** Adam / AdamW (amsgrad optional), as optimizer.cpp's chain: m.lerp_(g,
 * 1 - beta1) with PyTorch's two formulas, v = v beta2 + (1 - beta2) g g,
 * p += -(lr / bc1) m / (sqrt(v or max v) / bc2_sqrt + eps). */
template <class T>
struct AdamUpdate {
  T decay, wd, w, neg_keep, beta2, one_minus_beta2, bc2_sqrt, eps, step;
  bool decoupled, coupled, lerp_from_m, amsgrad;

  /** From settings whose `live` values (AdamStep::live) were read. Each
   * double rounded once, so the host and the device build the same. */
  QUANTA_HD explicit AdamUpdate(const AdamStep& s)
      : decay(static_cast<T>(sub_rn(1.0, mul_rn(s.lr, s.weight_decay)))),
        wd(static_cast<T>(s.weight_decay)),
        w(static_cast<T>(sub_rn(1.0, s.beta1))),
        neg_keep(static_cast<T>(-sub_rn(1.0, sub_rn(1.0, s.beta1)))),
        beta2(static_cast<T>(s.beta2)),
        one_minus_beta2(static_cast<T>(sub_rn(1.0, s.beta2))),
        bc2_sqrt(static_cast<T>(s.bc2_sqrt)),
        eps(static_cast<T>(s.eps)),
        step(static_cast<T>(-div_rn(s.lr, s.bc1))),
        decoupled(s.weight_decay != 0 && s.decoupled),
        coupled(s.weight_decay != 0 && !s.decoupled),
        lerp_from_m(sub_rn(1.0, s.beta1) < 0.5),
        amsgrad(s.amsgrad) {}

  /** The moments: decays p (AdamW), updates m, v (and the running max of
   * v); returns the value whose square root the denominator takes. */
  QUANTA_HD T moments(T& p, T g, T& m, T& v, T* vmax) const {
    if (decoupled) p = mul_rn(p, decay);
    if (coupled) g = mul_add(wd, p, g);
    const T diff = sub_rn(g, m);
    m = lerp_from_m ? mul_add(w, diff, m) : mul_add(neg_keep, diff, g);
    v = mul_add(mul_rn(one_minus_beta2, g), g, mul_rn(v, beta2));
    if (!amsgrad) return v;
    *vmax = Maximum{}(*vmax, v);
    return *vmax;
  }
  /** The parameter's move, given root = the square root of moments(). */
  QUANTA_HD void apply(T& p, T m, T root) const {
    const T denom = add_rn(div_rn(root, bc2_sqrt), eps);
    p = add_rounded(p, div_rn(mul_rn(step, m), denom));
  }
  /** The whole step with a correctly rounded square root (the device).
   * Two statements: as one call, `apply(p, m, sqrt_rn(moments(...)))`, the
   * order in which the arguments are evaluated is unspecified, and nvcc
   * copied m before moments() updated it (the first GPU run's Adam steps
   * used the previous step's m). */
  QUANTA_HD void operator()(T& p, T g, T& m, T& v, T* vmax) const {
    const T root = sqrt_rn(moments(p, g, m, v, vmax));
    apply(p, m, root);
  }
};

/** `s` with the values a captured step keeps in device memory
 * (SgdStep::live, AdamStep::live) read from there; `s` itself otherwise. */
QUANTA_HD inline SgdStep read_live(SgdStep s) {
  if (s.live) {
    s.lr = s.live[0];
    s.weight_decay = s.live[1];
    s.live = nullptr;
  }
  return s;
}
QUANTA_HD inline AdamStep read_live(AdamStep s) {
  if (s.live) {
    s.lr = s.live[0];
    s.weight_decay = s.live[1];
    s.bc1 = s.live[2];
    s.bc2_sqrt = s.live[3];
    s.live = nullptr;
  }
  return s;
}

/** Gradient clipping's total norm of `count` per-tensor norms (f64), added
 * in order: the max for p = inf (a NaN wins), (sum of n^2)^(1/2) for p = 2,
 * else (sum of n^p)^(1/p). */
QUANTA_HD inline double clip_total(const double* norms, int64_t count, double p) {
  const bool inf = std::isinf(p);
  double acc = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double n = norms[i];
    if (inf)
      acc = std::isnan(acc) ? acc : std::isnan(n) || n > acc ? n : acc;
    else
      acc = add_rn(acc, p == 2.0 ? mul_rn(n, n) : std::pow(n, p));
  }
  if (inf) return acc;
  return p == 2.0 ? sqrt_rn(acc) : std::pow(acc, 1.0 / p);
}

/** The factor clipping scales gradients by: max_norm / (total + 1e-6),
 * at most 1 (gradients within the limit are multiplied by exactly 1); a NaN
 * total gives NaN, as in PyTorch. */
QUANTA_HD inline double clip_factor(double total, double max_norm) {
  const double f = div_rn(max_norm, add_rn(total, 1e-6));
  return f > 1.0 ? 1.0 : f;
}

}  // namespace fn
}  // namespace quanta
