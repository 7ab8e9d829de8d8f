#pragma once
// Element loops over strided operands (the CPU kernels' one iteration
// primitive). Operands share one shape; broadcast inputs arrive as expanded
// views with stride 0. Contiguous operands take a flat, vectorisable path.
#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

#include "engine/cpu/parallel.h"
#include "engine/kernels/table.h"
#include "engine/tensor.h"

namespace quanta::cpu {

/** True when `strides` lay `shape` out row-major with no gaps (size-1 dims
 * may have any stride), as Tensor::is_contiguous decides. */
inline bool dense_strides(const Shape& shape, const int64_t* strides) {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (shape[i] == 0) return true;
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

/** Calls `kernel(n, bases, strides)` for runs of `n` elements whose operand
 * k starts at bases[k] and advances by strides[k] elements (on the flat path:
 * 1, or 0 for an input that is one value broadcast everywhere). Operand 0 is
 * the output. Runs may execute in parallel. */
template <size_t N, class Kernel>
void for_each_run(const Shape& shape, const std::array<const Operand*, N>& ops, Kernel&& kernel) {
  const int64_t n = numel_of(shape);
  if (n == 0) return;
  std::array<char*, N> base;
  std::array<int64_t, N> esize;
  // Flat when every operand is contiguous or one value broadcast everywhere
  // (all strides 0, e.g. the expanded gradient of a sum): one run per
  // thread, stride 1 or 0.
  bool flat = true;
  std::array<int64_t, N> flat_stride;
  for (size_t k = 0; k < N; ++k) {
    base[k] = static_cast<char*>(ops[k]->data);
    esize[k] = static_cast<int64_t>(element_size(ops[k]->dtype));
    const bool dense = dense_strides(shape, ops[k]->strides);
    bool splat = k > 0;  // the output is never a broadcast
    for (size_t d = 0; d < shape.size(); ++d) splat = splat && ops[k]->strides[d] == 0;
    flat_stride[k] = dense ? 1 : 0;
    flat = flat && (dense || splat);
  }
  if (flat) {
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      std::array<char*, N> b;
      for (size_t k = 0; k < N; ++k) b[k] = base[k] + lo * flat_stride[k] * esize[k];
      kernel(hi - lo, b, flat_stride);
    });
    return;
  }
  // Strided: the last dim is the run; the others are walked as a counter.
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t inner = nd ? shape[nd - 1] : 1;
  const int64_t outer = inner ? n / inner : 0;
  std::array<int64_t, N> inner_stride;
  for (size_t k = 0; k < N; ++k) inner_stride[k] = nd ? ops[k]->strides[nd - 1] : 0;
  parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t row = lo; row < hi; ++row) {
                   std::array<char*, N> b = base;
                   int64_t rem = row;
                   for (int64_t d = nd - 2; d >= 0; --d) {
                     const int64_t idx = rem % shape[d];
                     rem /= shape[d];
                     for (size_t k = 0; k < N; ++k) b[k] += idx * ops[k]->strides[d] * esize[k];
                   }
                   kernel(inner, b, inner_stride);
                 }
               });
}

template <class>
using OperandRef = const Operand&;

/** out[i] = f(in[i]...) over `shape` for typed operands; `out` is written. */
template <class Out, class... In, class F>
void map(const Shape& shape, F&& f, const Operand& out, OperandRef<In>... in) {
  constexpr size_t N = 1 + sizeof...(In);
  std::array<const Operand*, N> ops{&out, &in...};
  for_each_run<N>(
      shape, ops, [&](int64_t n, const std::array<char*, N>& b, const std::array<int64_t, N>& s) {
        Out* o = reinterpret_cast<Out*>(b[0]);
        bool unit = true, unit_or_splat = s[0] == 1;
        for (size_t k = 0; k < N; ++k) unit = unit && s[k] == 1;
        for (size_t k = 1; k < N; ++k) unit_or_splat = unit_or_splat && (s[k] == 1 || s[k] == 0);
        if (unit) {
          // Flat path: unit strides let the compiler vectorise.
          [&]<size_t... I>(std::index_sequence<I...>) {
            auto ptrs = std::make_tuple(reinterpret_cast<const In*>(b[I + 1])...);
            for (int64_t i = 0; i < n; ++i) o[i] = f(std::get<I>(ptrs)[i]...);
          }
          (std::index_sequence_for<In...>{});
        } else if (unit_or_splat) {
          // Inputs broadcast along the run (stride 0): their value is copied into
          // a small block once, so the loop is the vectorisable flat one.
          [&]<size_t... I>(std::index_sequence<I...>) {
            constexpr int64_t kBlock = 256;
            auto ptrs = std::make_tuple(reinterpret_cast<const In*>(b[I + 1])...);
            std::tuple<std::array<In, kBlock>...> splat;
            ((s[I + 1] == 0 ? std::get<I>(splat).fill(std::get<I>(ptrs)[0]) : void()), ...);
            for (int64_t lo = 0; lo < n; lo += kBlock) {
              const int64_t m = std::min(kBlock, n - lo);
              const auto p = std::make_tuple(
                  (s[I + 1] == 0 ? std::get<I>(splat).data() : std::get<I>(ptrs) + lo)...);
              Out* ob = o + lo;
              for (int64_t i = 0; i < m; ++i) ob[i] = f(std::get<I>(p)[i]...);
            }
          }
          (std::index_sequence_for<In...>{});
        } else {
          [&]<size_t... I>(std::index_sequence<I...>) {
            auto ptrs = std::make_tuple(reinterpret_cast<const In*>(b[I + 1])...);
            for (int64_t i = 0; i < n; ++i) o[i * s[0]] = f(std::get<I>(ptrs)[i * s[I + 1]]...);
          }
          (std::index_sequence_for<In...>{});
        }
      });
}

}  // namespace quanta::cpu
