#pragma once
// CPU-only vector forms of unary functors: an Eigen array expression used on
// contiguous data, and a fix-up pass for the rare inputs the vector formula
// gets wrong. A functor without a specialisation runs its scalar form.
#include <cmath>
#include <limits>
#include <type_traits>

#include "engine/kernels/functors.h"

namespace quanta::cpu {

template <class F>
struct VectorForm {
  static constexpr bool has = false;
};

#define QUANTA_VECTOR_FORM(F, expr)                   \
  template <>                                         \
  struct VectorForm<fn::F> {                          \
    static constexpr bool has = true;                 \
    static auto apply(const auto& a) { return expr; } \
    template <class T>                                \
    static void fixup(const T*, T*, int64_t) {}       \
  };

QUANTA_VECTOR_FORM(Abs, a.abs())
QUANTA_VECTOR_FORM(Log, a.log())
QUANTA_VECTOR_FORM(Log1p, a.log1p())
QUANTA_VECTOR_FORM(Sqrt, a.sqrt())
QUANTA_VECTOR_FORM(Rsqrt, a.rsqrt())
QUANTA_VECTOR_FORM(Sin, a.sin())
QUANTA_VECTOR_FORM(Cos, a.cos())
QUANTA_VECTOR_FORM(Tanh, a.tanh())
// The scalar forms' formulas with Eigen's vector exp (a decoder's SiLU and
// its gradient's sigmoid called libm's scalar expf once per element).
// Sigmoid stays stable: e = exp(-|a|) never overflows, and e / (1 + e) is
// the branch for negative a.
QUANTA_VECTOR_FORM(Silu, a / (1 + (-a).exp()))
#undef QUANTA_VECTOR_FORM

template <>
struct VectorForm<fn::Sigmoid> {
  static constexpr bool has = true;
  static auto apply(const auto& a) {
    return (a >= 0).select(1 / (1 + (-a.abs()).exp()), (-a.abs()).exp() / (1 + (-a.abs()).exp()));
  }
  // Eigen's clamped double exp again (see Exp): far below 0 the result is 0.
  template <class T>
  static void fixup(const T* src, T* dst, int64_t n) {
    const T underflow = std::log(std::numeric_limits<T>::denorm_min());
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] < underflow ? T(0) : dst[i];
  }
};

template <>
struct VectorForm<fn::Exp> {
  static constexpr bool has = true;
  static auto apply(const auto& a) { return a.exp(); }
  // Eigen's SSE2 double exp clamps its input, so exp(-inf) came out as
  // 5.6e-309 instead of 0 (a -inf logit got a sliver of probability).
  // Below log(denorm_min) the true result is 0 in every precision.
  template <class T>
  static void fixup(const T* src, T* dst, int64_t n) {
    const T underflow = std::log(std::numeric_limits<T>::denorm_min());
    // A select, not a branch: the compiler turns it into a vector blend.
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] < underflow ? T(0) : dst[i];
  }
};

}  // namespace quanta::cpu
