#pragma once
// CPU-only vector forms of unary functors: an Eigen array expression, and a
// fix-up pass for the rare inputs the vector formula gets wrong. A functor
// without a specialisation runs its scalar form, which the compiler
// vectorises where it can.
//
// A vector form's last bits differ from its scalar form's (Eigen's
// polynomials against libm), so elementwise_kernels.cpp runs every element
// of such a functor through it, whatever the tensor's layout. Only forms
// whose bits are the same on every x86-64 CPU belong here: Eigen's sqrt and
// rsqrt under EIGEN_FAST_MATH refine the CPU's rsqrt14 estimate by Newton
// steps (one in f32, two in f64): near full precision but not correctly
// rounded, and the estimate's bits differ between chips. So sqrt and rsqrt
// run their scalar forms, correctly rounded.
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

QUANTA_VECTOR_FORM(Log, a.log())
QUANTA_VECTOR_FORM(Log1p, a.log1p())
QUANTA_VECTOR_FORM(Sin, a.sin())
QUANTA_VECTOR_FORM(Cos, a.cos())
QUANTA_VECTOR_FORM(Tanh, a.tanh())
// The scalar form's formula with Eigen's vector exp (a decoder's SiLU
// called libm's scalar expf once per element).
QUANTA_VECTOR_FORM(Silu, a / (1 + (-a).exp()))
#undef QUANTA_VECTOR_FORM

// Sigmoid, stable: the vector pass is e = exp(-|a|) alone, which never
// overflows (Eigen's select does not vectorise: a select over exps ran
// libm's scalar expf three times per element); the fix-up pass forms the
// scalar form's two branches from e, 1 / (1 + e) for a >= 0 and
// e / (1 + e) below, a loop the compiler vectorises.
template <>
struct VectorForm<fn::Sigmoid> {
  static constexpr bool has = true;
  static auto apply(const auto& a) { return (-a.abs()).exp(); }
  template <class T>
  static void fixup(const T* src, T* dst, int64_t n) {
    // Eigen's clamped double exp again (see Exp): far below 0 the result is 0.
    const T underflow = std::log(std::numeric_limits<T>::denorm_min());
    for (int64_t i = 0; i < n; ++i) {
      const T e = dst[i], v = src[i];
      const T s = v >= 0 ? T(1) / (T(1) + e) : e / (T(1) + e);
      dst[i] = v < underflow ? T(0) : s;
    }
  }
};

}  // namespace quanta::cpu
