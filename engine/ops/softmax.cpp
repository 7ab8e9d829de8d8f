// softmax and log_softmax: one stable kernel over [outer, n, inner] lines and
// the two hand-written backward formulas.
#include "engine/ops/softmax.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <Eigen/Core>

#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/elementwise_kernels.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

// Contiguous rows (softmax over the last dim): Eigen's vectorised max, exp
// and sum.
template <bool Log, class T>
void softmax_rows(const T* x, T* y, int64_t rows, int64_t n) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  cpu::parallel_for(0, rows, std::max<int64_t>(1, cpu::kGrainElements / n),
                    [&](int64_t lo, int64_t hi) {
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
  cpu::parallel_for(0, outer, std::max<int64_t>(1, cpu::kGrainElements / block),
                    [&](int64_t lo, int64_t hi) {
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

template <bool Log>
Tensor softmax_impl(const Tensor& x, int64_t dim, const char* op) {
  detail::check_cpu(op, {&x});
  if (!dtype_info(x.dtype()).arithmetic)
    detail::bad_dtype(op, x.dtype(), "a byte-only format: dequantize it first");
  if (x.dim() == 0) {
    // A 0-d tensor is one slice of one element (dims 0 and -1 accepted).
    wrap_dim(dim, 0, op);
    return reshape(softmax_impl<Log>(reshape(x, {1}), 0, op), {});
  }
  const int64_t d = wrap_dim(dim, x.dim(), op);
  const DType out_dt = to_floating(x.dtype());
  const DType ct = detail::cpu_compute_dtype(out_dt);
  const Tensor in = detail::as_plain(x, ct).contiguous();
  Tensor out = detail::make_tensor(x.shape(), ct, Device::cpu());
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < d; ++k) outer *= x.shape()[k];
  for (int64_t k = d + 1; k < x.dim(); ++k) inner *= x.shape()[k];
  dispatch_float(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_kernel<Log, T>(in.data<T>(), out.data<T>(), outer, x.shape()[d], inner);
  });
  if (ct != out_dt) out = detail::as_plain(out, out_dt);
  return autograd::record(op, out, {x}, [y = out.detach(), d](const Tensor& g) {
    // softmax: y (g - sum(g y)); log_softmax: g - exp(y) sum(g).
    if constexpr (Log) return std::vector<Tensor>{sub(g, mul(exp(y), sum(g, {d}, true)))};
    else return std::vector<Tensor>{mul(y, sub(g, sum(mul(g, y), {d}, true)))};
  });
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl<false>(x, dim, "softmax"); }

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_impl<true>(x, dim, "log_softmax");
}

}  // namespace quanta
