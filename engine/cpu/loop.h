#pragma once
// Element loops over strided operands (the CPU kernels' one iteration
// primitive). Operands share one shape; broadcast inputs arrive as expanded
// views with stride 0. Contiguous operands take a flat, vectorisable path.
#include <array>
#include <cstdint>
#include <utility>

#include "engine/cpu/parallel.h"
#include "engine/tensor.h"

namespace quanta::cpu {

/** Calls `f(ptrs...)` style kernels: `kernel(n, bases, strides)` is called
 * for runs of `n` elements whose operand k starts at bases[k] and advances by
 * strides[k] elements (1 on the flat path). Runs may execute in parallel. */
template <size_t N, class Kernel>
void for_each_run(const Shape& shape, const std::array<const Tensor*, N>& ops,
                  Kernel&& kernel) {
  const int64_t n = numel_of(shape);
  if (n == 0) return;
  std::array<char*, N> base;
  std::array<int64_t, N> esize;
  bool all_contiguous = true;
  for (size_t k = 0; k < N; ++k) {
    base[k] = static_cast<char*>(ops[k]->raw_data());
    esize[k] = static_cast<int64_t>(element_size(ops[k]->dtype()));
    all_contiguous = all_contiguous && ops[k]->is_contiguous() && ops[k]->shape() == shape;
  }
  if (all_contiguous) {
    std::array<int64_t, N> unit;
    unit.fill(1);
    parallel_for(0, n, kGrainElements, [&](int64_t lo, int64_t hi) {
      std::array<char*, N> b;
      for (size_t k = 0; k < N; ++k) b[k] = base[k] + lo * esize[k];
      kernel(hi - lo, b, unit);
    });
    return;
  }
  // Strided: the last dim is the run; the others are walked as a counter.
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t inner = nd ? shape[nd - 1] : 1;
  const int64_t outer = inner ? n / inner : 0;
  std::array<int64_t, N> inner_stride;
  for (size_t k = 0; k < N; ++k) inner_stride[k] = nd ? ops[k]->strides()[nd - 1] : 0;
  parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)),
               [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      std::array<char*, N> b = base;
      int64_t rem = row;
      for (int64_t d = nd - 2; d >= 0; --d) {
        const int64_t idx = rem % shape[d];
        rem /= shape[d];
        for (size_t k = 0; k < N; ++k) b[k] += idx * ops[k]->strides()[d] * esize[k];
      }
      kernel(inner, b, inner_stride);
    }
  });
}

template <class> using TensorRef = const Tensor&;

/** out[i] = f(in[i]...) for typed operands; `out` is written. */
template <class Out, class... In, class F>
void map(const Tensor& out, F&& f, TensorRef<In>... in) {
  constexpr size_t N = 1 + sizeof...(In);
  std::array<const Tensor*, N> ops{&out, &in...};
  for_each_run<N>(out.shape(), ops,
                  [&](int64_t n, const std::array<char*, N>& b,
                      const std::array<int64_t, N>& s) {
    Out* o = reinterpret_cast<Out*>(b[0]);
    bool unit = true;
    for (size_t k = 0; k < N; ++k) unit = unit && s[k] == 1;
    if (unit) {
      // Flat path: unit strides let the compiler vectorise.
      [&]<size_t... I>(std::index_sequence<I...>) {
        auto ptrs = std::make_tuple(reinterpret_cast<const In*>(b[I + 1])...);
        for (int64_t i = 0; i < n; ++i) o[i] = f(std::get<I>(ptrs)[i]...);
      }(std::index_sequence_for<In...>{});
    } else {
      [&]<size_t... I>(std::index_sequence<I...>) {
        auto ptrs = std::make_tuple(reinterpret_cast<const In*>(b[I + 1])...);
        for (int64_t i = 0; i < n; ++i)
          o[i * s[0]] = f(std::get<I>(ptrs)[i * s[I + 1]]...);
      }(std::index_sequence_for<In...>{});
    }
  });
}

}  // namespace quanta::cpu
