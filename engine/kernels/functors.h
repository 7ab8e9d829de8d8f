#pragma once
// The elementwise math, written once as named functors that g++ and nvcc both
// compile. The CPU kernels (engine/cpu/) and the CUDA kernels (engine/cuda/)
// call the same functor, so the CPU tests cover the math the GPU runs. The
// lists at the bottom (QUANTA_UNARY_OPS, ...) are the one place an op's enum,
// name and functor are tied together; both kernel tables expand them.
//
// Each functor holds its scalar arguments (ScalarArgs) and converts them to
// the element type at the call, as the CPU lambdas it replaced did, so the
// CPU results are bit for bit the same. Eigen vector forms and their fix-ups
// stay CPU-only, in engine/cpu/unary_vector.h.
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define QUANTA_HD __host__ __device__
#else
#define QUANTA_HD
#endif

namespace quanta {

/** Scalar arguments of a parameterised elementwise op (slope, exponent,
 * bounds, alpha); their meaning is the functor's. */
struct ScalarArgs {
  double a = 0.0;
  double b = 0.0;
};

namespace fn {

namespace detail {
inline constexpr double kSqrt2OverPi = 0.7978845608028654;
inline constexpr double kInvSqrt2 = 0.7071067811865476;
inline constexpr double kInvSqrt2Pi = 0.3989422804014327;

/** The inverse error function on [-1, 1] (+-inf at +-1, NaN outside): Giles'
 * single-precision approximation ("Approximating the erfinv function", GPU
 * Computing Gems, 2011), then two Newton steps on erf in T, which bring a
 * double to full precision. */
template <class T>
QUANTA_HD T erfinv(T x) {
  if (!(x > T(-1) && x < T(1))) {
    if (x == T(1)) return T(HUGE_VAL);
    if (x == T(-1)) return T(-HUGE_VAL);
    return T(NAN);
  }
  double w = -std::log((1.0 - double(x)) * (1.0 + double(x))), p;
  if (w < 5.0) {
    w -= 2.5;
    p = 2.81022636e-08;
    p = 3.43273939e-07 + p * w;
    p = -3.5233877e-06 + p * w;
    p = -4.39150654e-06 + p * w;
    p = 0.00021858087 + p * w;
    p = -0.00125372503 + p * w;
    p = -0.00417768164 + p * w;
    p = 0.246640727 + p * w;
    p = 1.50140941 + p * w;
  } else {
    w = std::sqrt(w) - 3.0;
    p = -0.000200214257;
    p = 0.000100950558 + p * w;
    p = 0.00134934322 + p * w;
    p = -0.00367342844 + p * w;
    p = 0.00573950773 + p * w;
    p = -0.0076224613 + p * w;
    p = 0.00943887047 + p * w;
    p = 1.00167406 + p * w;
    p = 2.83297682 + p * w;
  }
  T y = T(p * double(x));
  for (int i = 0; i < 2; ++i)  // Newton: erf'(y) = 2/sqrt(pi) exp(-y^2)
    y -= (std::erf(y) - x) / (T(1.1283791670955126) * std::exp(-y * y));
  return y;
}
}  // namespace detail

// The functor and op-list macros below are hand-aligned: clang-format 14
// reads an expression argument like `x * y` as a declaration (`x* y`) and
// does not format the X-macro lists idempotently.
// clang-format off
// ---- unary (floating: f32 and f64) ----
#define QUANTA_UNARY_FUNCTOR(Name, expr)                              \
  struct Name {                                                       \
    ScalarArgs s;                                                     \
    template <class T>                                                \
    QUANTA_HD T operator()(T v) const {                               \
      (void)s;                                                        \
      return expr;                                                    \
    }                                                                 \
  };

QUANTA_UNARY_FUNCTOR(Neg, -v)
QUANTA_UNARY_FUNCTOR(Abs, std::abs(v))
QUANTA_UNARY_FUNCTOR(Exp, std::exp(v))
QUANTA_UNARY_FUNCTOR(Log, std::log(v))
QUANTA_UNARY_FUNCTOR(Log1p, std::log1p(v))
QUANTA_UNARY_FUNCTOR(Sqrt, std::sqrt(v))
QUANTA_UNARY_FUNCTOR(Rsqrt, T(1) / std::sqrt(v))
QUANTA_UNARY_FUNCTOR(Sin, std::sin(v))
QUANTA_UNARY_FUNCTOR(Cos, std::cos(v))
QUANTA_UNARY_FUNCTOR(Tanh, std::tanh(v))
QUANTA_UNARY_FUNCTOR(Erf, std::erf(v))
QUANTA_UNARY_FUNCTOR(Erfinv, detail::erfinv(v))
QUANTA_UNARY_FUNCTOR(Atan, std::atan(v))
// Stable for large |v|: never exponentiate a large positive number.
QUANTA_UNARY_FUNCTOR(Sigmoid,
                     v >= 0 ? T(1) / (T(1) + std::exp(-v)) : std::exp(v) / (T(1) + std::exp(v)))
QUANTA_UNARY_FUNCTOR(Relu, v > 0 ? v : T(0))
/** s.a: the negative slope. */
QUANTA_UNARY_FUNCTOR(LeakyRelu, v > 0 ? v : static_cast<T>(s.a) * v)
QUANTA_UNARY_FUNCTOR(GeluErf, T(0.5) * v * (T(1) + std::erf(v * T(detail::kInvSqrt2))))
/** d/dx of the exact GELU. */
QUANTA_UNARY_FUNCTOR(GeluErfGrad, T(0.5) * (T(1) + std::erf(v * T(detail::kInvSqrt2))) +
                                      v * T(detail::kInvSqrt2Pi) * std::exp(T(-0.5) * v * v))
QUANTA_UNARY_FUNCTOR(GeluTanh,
                     T(0.5) * v *
                         (T(1) + std::tanh(T(detail::kSqrt2OverPi) * (v + T(0.044715) * v * v * v))))
QUANTA_UNARY_FUNCTOR(Silu, v / (T(1) + std::exp(-v)))
/** s.a: beta, s.b: threshold (linear above it, like PyTorch). */
QUANTA_UNARY_FUNCTOR(Softplus, T(s.a) * v > T(s.b) ? v
                                                   : std::log1p(std::exp(T(s.a) * v)) / T(s.a))
QUANTA_UNARY_FUNCTOR(Square, v * v)
/** s.a: the exponent. */
QUANTA_UNARY_FUNCTOR(PowScalar, static_cast<T>(std::pow(v, static_cast<T>(s.a))))
/** s.a: lower bound, s.b: upper bound; a NaN bound leaves its side open (a
 * comparison with NaN is false), and NaN input stays NaN. */
struct Clamp {
  ScalarArgs s;
  template <class T>
  QUANTA_HD T operator()(T v) const {
    if (v != v) return v;
    if (v < T(s.a)) v = T(s.a);
    if (v > T(s.b)) v = T(s.b);  // hi wins when lo > hi, like torch.clamp
    return v;
  }
};
/** Keeps 0 and NaN. */
QUANTA_UNARY_FUNCTOR(Sign, v > 0 ? T(1) : (v < 0 ? T(-1) : v))
/** Half to even, like torch.round. */
QUANTA_UNARY_FUNCTOR(Round, std::nearbyint(v))
QUANTA_UNARY_FUNCTOR(Floor, std::floor(v))
QUANTA_UNARY_FUNCTOR(Ceil, std::ceil(v))
#undef QUANTA_UNARY_FUNCTOR

// ---- binary (every numeric dtype) ----
#define QUANTA_BINARY_FUNCTOR(Name, expr)                             \
  struct Name {                                                       \
    template <class T>                                                \
    QUANTA_HD auto operator()(T x, T y) const {                       \
      return expr;                                                    \
    }                                                                 \
  };

QUANTA_BINARY_FUNCTOR(Add, x + y)
QUANTA_BINARY_FUNCTOR(Sub, x - y)
QUANTA_BINARY_FUNCTOR(Mul, x * y)
QUANTA_BINARY_FUNCTOR(Div, x / y)
QUANTA_BINARY_FUNCTOR(Pow, std::pow(x, y))
// NaN propagates from either side.
QUANTA_BINARY_FUNCTOR(Maximum, (x != x) ? x : (y != y ? y : (x > y ? x : y)))
QUANTA_BINARY_FUNCTOR(Minimum, (x != x) ? x : (y != y ? y : (x < y ? x : y)))
/** ReLU's backward: the gradient x where the input y is positive, else 0
 * (NaN inputs pass nothing, as where(y > 0, x, 0) does). */
QUANTA_BINARY_FUNCTOR(ReluBackward, y > T(0) ? x : T(0))
QUANTA_BINARY_FUNCTOR(Eq, x == y)
QUANTA_BINARY_FUNCTOR(Ne, x != y)
QUANTA_BINARY_FUNCTOR(Lt, x < y)
QUANTA_BINARY_FUNCTOR(Le, x <= y)
QUANTA_BINARY_FUNCTOR(Gt, x > y)
QUANTA_BINARY_FUNCTOR(Ge, x >= y)
QUANTA_BINARY_FUNCTOR(LogicalAnd, x && y)
QUANTA_BINARY_FUNCTOR(LogicalOr, x || y)
QUANTA_BINARY_FUNCTOR(LogicalXor, (x != 0) != (y != 0))
#undef QUANTA_BINARY_FUNCTOR

// ---- in-place updates d = f(d, x, y) (every numeric dtype) ----
#define QUANTA_UPDATE_FUNCTOR(Name, expr)                             \
  struct Name {                                                       \
    ScalarArgs s;                                                     \
    template <class T>                                                \
    QUANTA_HD T operator()(T d, T x, T y) const {                     \
      (void)s;                                                        \
      (void)y;                                                        \
      return static_cast<T>(expr);                                    \
    }                                                                 \
  };

/** d + alpha x (s.a: alpha). */
QUANTA_UPDATE_FUNCTOR(AddScaled, d + static_cast<T>(s.a) * x)
QUANTA_UPDATE_FUNCTOR(MulInto, d * x)
QUANTA_UPDATE_FUNCTOR(DivInto, d / x)
/** d + alpha x y (s.a: alpha). */
QUANTA_UPDATE_FUNCTOR(Addcmul, d + static_cast<T>(s.a) * x * y)
/** d + alpha x / y (s.a: alpha). */
QUANTA_UPDATE_FUNCTOR(Addcdiv, d + static_cast<T>(s.a) * x / y)
#undef QUANTA_UPDATE_FUNCTOR

}  // namespace fn

// The op lists: X(enum name, functor). Appending a row here and a case in
// nothing else is how a new elementwise op reaches every device's table.
#define QUANTA_UNARY_OPS(X)                                                            \
  X(neg, Neg) X(abs, Abs) X(exp, Exp) X(log, Log) X(log1p, Log1p) X(sqrt, Sqrt)         \
  X(rsqrt, Rsqrt) X(sin, Sin) X(cos, Cos) X(tanh, Tanh) X(erf, Erf) X(sigmoid, Sigmoid) \
  X(relu, Relu) X(leaky_relu, LeakyRelu) X(gelu, GeluErf) X(gelu_backward, GeluErfGrad) \
  X(gelu_tanh, GeluTanh) X(silu, Silu) X(softplus, Softplus) X(square, Square)          \
  X(pow_scalar, PowScalar) X(clamp, Clamp) X(sign, Sign) X(round, Round)                \
  X(floor, Floor) X(ceil, Ceil) X(erfinv, Erfinv) X(atan, Atan)

// Arithmetic ops write the compute dtype; predicates write bool.
#define QUANTA_ARITH_OPS(X) \
  X(add, Add) X(sub, Sub) X(mul, Mul) X(div, Div) X(pow, Pow) X(maximum, Maximum) X(minimum, Minimum) \
  X(relu_backward, ReluBackward)
#define QUANTA_PREDICATE_OPS(X)                                                 \
  X(eq, Eq) X(ne, Ne) X(lt, Lt) X(le, Le) X(gt, Gt) X(ge, Ge) X(logical_and, LogicalAnd) \
  X(logical_or, LogicalOr) X(logical_xor, LogicalXor)
#define QUANTA_BINARY_OPS(X) QUANTA_ARITH_OPS(X) QUANTA_PREDICATE_OPS(X)

#define QUANTA_UPDATE_OPS(X) \
  X(add_scaled, AddScaled) X(mul, MulInto) X(div, DivInto) X(addcmul, Addcmul) X(addcdiv, Addcdiv)

#define QUANTA_ENUM_ROW(name, F) name,
enum class UnaryOp : uint8_t { QUANTA_UNARY_OPS(QUANTA_ENUM_ROW) };
enum class BinaryOp : uint8_t { QUANTA_BINARY_OPS(QUANTA_ENUM_ROW) };
enum class UpdateOp : uint8_t { QUANTA_UPDATE_OPS(QUANTA_ENUM_ROW) };
#undef QUANTA_ENUM_ROW
// clang-format on

/** True for the ops whose result is bool (comparisons, logic). */
constexpr bool is_predicate(BinaryOp op) { return op >= BinaryOp::eq; }

// The one switch from an op to its functor (host code): every device's
// elementwise entry calls visit_functor and wraps the functor in its loop.

/** Calls visit(functor) with `op`'s functor, made from `args`. */
template <class Visit>
void visit_functor(UnaryOp op, const ScalarArgs& args, Visit&& visit) {
  switch (op) {
#define QUANTA_CASE(name, F) \
  case UnaryOp::name:        \
    return visit(fn::F{args});
    QUANTA_UNARY_OPS(QUANTA_CASE)
#undef QUANTA_CASE
  }
}

/** Calls visit(functor, std::bool_constant<writes bool>) with `op`'s functor. */
template <class Visit>
void visit_functor(BinaryOp op, Visit&& visit) {
  switch (op) {
#define QUANTA_ARITH_CASE(name, F) \
  case BinaryOp::name:             \
    return visit(fn::F{}, std::false_type{});
#define QUANTA_PREDICATE_CASE(name, F) \
  case BinaryOp::name:                 \
    return visit(fn::F{}, std::true_type{});
    QUANTA_ARITH_OPS(QUANTA_ARITH_CASE)
    QUANTA_PREDICATE_OPS(QUANTA_PREDICATE_CASE)
#undef QUANTA_ARITH_CASE
#undef QUANTA_PREDICATE_CASE
  }
}

/** Calls visit(functor) with `op`'s functor, made from `args`. */
template <class Visit>
void visit_functor(UpdateOp op, const ScalarArgs& args, Visit&& visit) {
  switch (op) {
#define QUANTA_CASE(name, F) \
  case UpdateOp::name:       \
    return visit(fn::F{args});
    QUANTA_UPDATE_OPS(QUANTA_CASE)
#undef QUANTA_CASE
  }
}

}  // namespace quanta
