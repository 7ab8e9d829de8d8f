// The CPU's fused RMSNorm, forward and backward, one row per task.
#include <algorithm>
#include <vector>

#include "engine/cpu/parallel.h"
#include "llm/cpu/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cpu {

using cpu::kGrainElements;
using cpu::parallel_for;

void rms_norm(DType dtype, const void* x_, const void* weight_, int64_t rows, int64_t n, double eps,
              RmsWeight how, void* y_, void* inv_rms_) {
  dispatch_llm(dtype, "rms_norm", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const T* x = static_cast<const T*>(x_);
    const T* w = static_cast<const T*>(weight_);
    T* y = static_cast<T*>(y_);
    A* inv_rms = static_cast<A*>(inv_rms_);
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
    parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = x + r * n;
        A sum_sq = 0;
        for (int64_t j = 0; j < n; ++j) {
          const A v = static_cast<A>(xr[j]);
          sum_sq += v * v;
        }
        const A scale = fn::rms_scale<A>(sum_sq, n, static_cast<A>(eps));
        inv_rms[r] = scale;
        T* yr = y + r * n;
        for (int64_t j = 0; j < n; ++j) yr[j] = fn::rms_out<T, A>(xr[j], w[j], scale, how);
      }
    });
  });
}

void rms_norm_grad(DType dtype, const void* x_, const void* weight_, RmsWeight how,
                   const void* inv_rms_, const void* gy_, int64_t rows, int64_t n, void* gx_,
                   void* gw_, bool accumulate_gx) {
  dispatch_llm(dtype, "rms_norm backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const T* x = static_cast<const T*>(x_);
    const T* w = static_cast<const T*>(weight_);
    const A* inv_rms = static_cast<const A*>(inv_rms_);
    const T* gy = static_cast<const T*>(gy_);
    T* gx = static_cast<T*>(gx_);
    T* gw = static_cast<T*>(gw_);
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
    if (gx)
      parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          const T* xr = x + r * n;
          const T* gr = gy + r * n;
          const A scale = inv_rms[r];
          A dot = 0;
          for (int64_t j = 0; j < n; ++j)
            dot += static_cast<A>(gr[j]) * fn::rms_factor<T, A>(w[j], how) * static_cast<A>(xr[j]);
          const A c = dot / static_cast<A>(n);
          T* out = gx + r * n;
          for (int64_t j = 0; j < n; ++j) {
            const A v = fn::rms_grad_x<A>(static_cast<A>(xr[j]),
                                          static_cast<A>(gr[j]) * fn::rms_factor<T, A>(w[j], how),
                                          scale, c);
            out[j] = static_cast<T>(accumulate_gx ? static_cast<A>(out[j]) + v : v);
          }
        }
      });
    if (!gw) return;
    // The weight's gradient: columns split among threads, each column's sum
    // taken over the rows in order (the same bits for any thread count).
    const int64_t col_grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(rows, 1));
    parallel_for(0, n, col_grain, [&](int64_t lo, int64_t hi) {
      std::vector<A> acc(static_cast<size_t>(hi - lo), A(0));
      for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * n;
        const T* gr = gy + r * n;
        const A scale = inv_rms[r];
        for (int64_t j = lo; j < hi; ++j)
          acc[j - lo] += static_cast<A>(gr[j]) * static_cast<A>(xr[j]) * scale;
      }
      for (int64_t j = lo; j < hi; ++j) gw[j] = static_cast<T>(acc[j - lo]);
    });
  });
}

}  // namespace quanta::llm::llm_cpu
