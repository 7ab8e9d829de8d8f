// The CPU's elementwise families: fill, cast/copy, unary, binary, in-place
// update and where. The math is the shared functors (engine/kernels/);
// this file adds the loops, the dtype switch and the Eigen vector forms.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/cpu/convert.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/loop.h"
#include "engine/cpu/parallel.h"
#include "engine/cpu/unary_vector.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"

namespace quanta::cpu {
namespace {

template <class T, class F>
void unary_typed(const F& f, const Shape& shape, const Operand& out, const Operand& in) {
  if constexpr (VectorForm<F>::has) {
    if (dense_strides(shape, in.strides) && dense_strides(shape, out.strides)) {
      const T* src = static_cast<const T*>(in.data);
      T* dst = static_cast<T*>(out.data);
      parallel_for(0, numel_of(shape), kGrainElements, [&](int64_t lo, int64_t hi) {
        using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
        // In L1/L2-sized pieces, so the fixup pass reads what the vector
        // pass just touched instead of streaming the chunk from memory again.
        constexpr int64_t kPiece = 8192;
        for (int64_t a = lo; a < hi; a += kPiece) {
          const int64_t b = std::min(hi, a + kPiece);
          Eigen::Map<Arr>(dst + a, b - a) =
              VectorForm<F>::apply(Eigen::Map<const Arr>(src + a, b - a));
          VectorForm<F>::fixup(src + a, dst + a, b - a);
        }
      });
      return;
    }
  }
  map<T, T>(shape, f, out, in);
}

template <class T, bool Predicate, class F>
void binary_typed(const F& f, const Shape& shape, const Operand& out, const Operand& a,
                  const Operand& b) {
  if constexpr (Predicate) {
    map<bool, T, T>(
        shape, [&](T x, T y) { return static_cast<bool>(f(x, y)); }, out, a, b);
  } else {
    map<T, T, T>(
        shape, [&](T x, T y) { return static_cast<T>(f(x, y)); }, out, a, b);
  }
}

}  // namespace

void fill(const Shape& shape, const Operand& dst, double value) {
  dispatch_all(dst.dtype, "fill_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = cast<T>(value);
    for_each_run<1>(shape, {&dst},
                    [&](int64_t n, const std::array<char*, 1>& b, const std::array<int64_t, 1>& s) {
                      T* p = reinterpret_cast<T*>(b[0]);
                      for (int64_t i = 0; i < n; ++i) p[i * s[0]] = v;
                    });
  });
}

void copy(const Shape& shape, const Operand& dst, const Operand& src) {
  dispatch_all(dst.dtype, "copy_", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_all(src.dtype, "copy_", [&](auto stag) {
      using S = typename decltype(stag)::type;
      map<D, S>(
          shape, [](S v) { return cast<D>(v); }, dst, src);
    });
  });
}

void unary(UnaryOp op, const ScalarArgs& args, const Shape& shape, const Operand& out,
           const Operand& in) {
  dispatch_float(in.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_functor(op, args, [&](auto f) { unary_typed<T>(f, shape, out, in); });
  });
}

void binary(BinaryOp op, const Shape& shape, const Operand& out, const Operand& a,
            const Operand& b) {
  dispatch_numeric(a.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_functor(op, [&](auto f, auto writes_bool) {
      binary_typed<T, decltype(writes_bool)::value>(f, shape, out, a, b);
    });
  });
}

void update(UpdateOp op, const ScalarArgs& args, const Shape& shape, const Operand& dst,
            const Operand& a, const Operand& b) {
  dispatch_numeric(dst.dtype, op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_functor(op, args, [&](auto f) { map<T, T, T, T>(shape, f, dst, dst, a, b); });
  });
}

void where(const Shape& shape, const Operand& out, const Operand& cond, const Operand& a,
           const Operand& b) {
  dispatch_all(out.dtype, "where", [&](auto tag) {
    using T = typename decltype(tag)::type;
    map<T, bool, T, T>(
        shape, [](bool k, T x, T y) { return k ? x : y; }, out, cond, a, b);
  });
}

void add_n(DType dtype, const TermList& terms, int64_t n, void* out) {
  dispatch_float(dtype, "add_n", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* dst = static_cast<T*>(out);
    const auto term = [&](int64_t t) { return static_cast<const T*>(terms.data[t]); };
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      // Blocks that stay in L1 while every term is added into them in order.
      constexpr int64_t kBlock = 2048;
      for (int64_t b = lo; b < hi; b += kBlock) {
        const int64_t e = std::min(hi, b + kBlock);
        const T* s0 = term(0);
        for (int64_t i = b; i < e; ++i) dst[i] = s0[i];
        for (int64_t t = 1; t < terms.count; ++t) {
          const T* st = term(t);
          for (int64_t i = b; i < e; ++i) dst[i] += st[i];
        }
      }
    });
  });
}

}  // namespace quanta::cpu
