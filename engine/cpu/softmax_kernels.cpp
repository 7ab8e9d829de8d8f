// The CPU's softmax and log_softmax: one stable kernel over the lines of a
// contiguous [outer, n, inner] block.
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"

namespace quanta::cpu {
namespace {

// Contiguous rows (softmax over the last dim): Eigen's vectorised max, exp
// and sum.
template <bool Log, class T>
void softmax_rows(const T* x, T* y, int64_t rows, int64_t n) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / n), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      Eigen::Map<const Arr> a(x + r * n, n);
      Eigen::Map<Arr> b(y + r * n, n);
      // A NaN anywhere makes the whole row NaN, whichever max Eigen returns.
      const T m = a.maxCoeff();
      if constexpr (Log) {
        b = a - (m + std::log((a - m).exp().sum()));
      } else {
        b = (a - m).exp();
        b *= T(1) / b.sum();
      }
    }
  });
}

// x and y viewed as [outer, n, inner] with inner > 1, reduced over n. The
// loops run over n outside and inner inside, so every pass reads memory in
// order and the inner loop vectorises.
template <bool Log, class T>
void softmax_strided(const T* x, T* y, int64_t outer, int64_t n, int64_t inner) {
  const int64_t block = n * inner;
  parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / block), [&](int64_t lo, int64_t hi) {
    std::vector<T> m(inner), s(inner);
    for (int64_t o = lo; o < hi; ++o) {
      const T* a = x + o * block;
      T* b = y + o * block;
      std::fill(m.begin(), m.end(), T(-INFINITY));
      std::fill(s.begin(), s.end(), T(0));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < inner; ++k) m[k] = std::max(m[k], a[i * inner + k]);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < inner; ++k) {
          const T e = std::exp(a[i * inner + k] - m[k]);
          s[k] += e;
          if constexpr (!Log) b[i * inner + k] = e;
        }
      if constexpr (Log) {
        for (int64_t k = 0; k < inner; ++k) m[k] += std::log(s[k]);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t k = 0; k < inner; ++k) b[i * inner + k] = a[i * inner + k] - m[k];
      } else {
        for (int64_t k = 0; k < inner; ++k) s[k] = T(1) / s[k];
        for (int64_t i = 0; i < n; ++i)
          for (int64_t k = 0; k < inner; ++k) b[i * inner + k] *= s[k];
      }
    }
  });
}

template <bool Log, class T>
void softmax_kernel(const T* x, T* y, int64_t outer, int64_t n, int64_t inner) {
  if (outer * n * inner == 0) return;
  if (inner == 1) {
    softmax_rows<Log, T>(x, y, outer, n);
  } else {
    softmax_strided<Log, T>(x, y, outer, n, inner);
  }
}

}  // namespace

void softmax(bool log, DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner,
             void* out) {
  dispatch_float(dtype, log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(in);
    T* y = static_cast<T*>(out);
    if (log) {
      softmax_kernel<true, T>(x, y, outer, n, inner);
    } else {
      softmax_kernel<false, T>(x, y, outer, n, inner);
    }
  });
}

}  // namespace quanta::cpu
