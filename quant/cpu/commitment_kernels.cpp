// CPU entries squared_error, squared_error_mean, squared_error_coefficient
// and squared_error_grad (quant/kernels/table.h): the commitment loss's
// forward and backward, one pass each, and the scalars between them.
#include <algorithm>
#include <vector>

#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "quant/cpu/kernels.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cpu {
namespace {

// |a - b|^2 over one row, in SIMD lanes (GCC keeps a plain float sum serial;
// the row pointers are parameters so no closure load blocks vectorising).
template <class T>
T squared_distance(const T* a, const T* b, int64_t d) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < d; ++e) s += (a[e] - b[e]) * (a[e] - b[e]);
  return s;
}

}  // namespace

void squared_error(DType dtype, const void* x, const void* q, const uint8_t* valid, int64_t rows,
                   int64_t d, double* out) {
  dispatch_float(dtype, "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const std::vector<T> w = row_weights<T>(valid, rows);
    const T* px = static_cast<const T*>(x);
    const T* pq = static_cast<const T*>(q);
    // Rows in chunks; each chunk's partial sum in f64, added in order, so
    // the total does not depend on the thread count.
    const int64_t chunk = 256;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    cpu::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        double s = 0;
        for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
          if (!w.empty() && w[r] == T(0)) continue;
          s += squared_distance(px + r * d, pq + r * d, d);
        }
        partial[c] = s;
      }
    });
    double total = 0;
    for (double p : partial) total += p;
    double count = 0;
    if (w.empty())
      count = double(rows);
    else
      for (T v : w) count += double(v);
    out[0] = total;
    out[1] = count * double(d);
  });
}

void squared_error_mean(DType dtype, const double* sums, void* mean) {
  dispatch_float(dtype, "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    *static_cast<T*>(mean) = static_cast<T>(fn::squared_error_mean(sums));
  });
}

void squared_error_coefficient(DType g_dtype, const void* g, double scale, const double* sums,
                               double* coef) {
  dispatch_float(g_dtype, "commitment_loss backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    *coef = fn::squared_error_coefficient(double(*static_cast<const T*>(g)), scale, sums);
  });
}

void squared_error_grad(DType dtype, const void* x, const void* q, const uint8_t* valid,
                        int64_t rows, int64_t d, const double* scale, void* gx) {
  dispatch_float(dtype, "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const std::vector<T> w = row_weights<T>(valid, rows);
    const T* px = static_cast<const T*>(x);
    const T* pq = static_cast<const T*>(q);
    T* out = static_cast<T*>(gx);
    const T g = T(*scale);
    const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(d, 1));
    cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        T* o = out + r * d;
        if (!w.empty() && w[r] == T(0)) {  // masked: exactly 0, whatever x holds
          std::fill(o, o + d, T(0));
          continue;
        }
        for (int64_t e = 0; e < d; ++e) o[e] = fn::commit_grad(g, px[r * d + e], pq[r * d + e]);
      }
    });
  });
}

}  // namespace quanta::quant::quant_cpu
