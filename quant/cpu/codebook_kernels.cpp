// CPU entries dead_code_picks, replace_codes and code_statistics
// (quant/kernels/table.h): the codebook's choices and in-place row writes of
// a dead-code step (only the replaced rows are touched), and the counts and
// sums of an assignment.
#include <algorithm>

#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "quant/cpu/kernels.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cpu {

void dead_code_picks(DType dtype, const void* cluster_size, int64_t k, double threshold,
                     const int64_t* draws, int64_t* picks) {
  dispatch_float(dtype, "Codebook", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* size = static_cast<const T*>(cluster_size);
    const T limit = static_cast<T>(threshold);
    int64_t j = 0;
    for (int64_t c = 0; c < k; ++c) picks[c] = size[c] < limit ? draws[j++] : -1;
  });
}

void replace_codes(DType dtype, int64_t k, int64_t d, const int64_t* picks, bool gather,
                   const void* src, double threshold, void* embed, void* embed_avg,
                   void* cluster_size) {
  dispatch_float(dtype, "Codebook", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(src);
    T* e = static_cast<T*>(embed);
    T* avg = static_cast<T*>(embed_avg);
    T* size = static_cast<T*>(cluster_size);
    const T one = T(1.0), limit = static_cast<T>(threshold);
    for (int64_t c = 0; c < k; ++c) {
      if (picks[c] < 0) continue;
      const T* row = in + (gather ? picks[c] : c) * d;
      for (int64_t i = 0; i < d; ++i) {
        e[c * d + i] = one * row[i];
        avg[c * d + i] = limit * row[i];
      }
      size[c] = limit;
    }
  });
}

// Columns in parallel, each walked over the rows in order: every code's sum
// is added in row order whatever the thread count (index_add's bits).
void code_statistics(DType dtype, const int64_t* idx, const void* x, int64_t n, int64_t k,
                     int64_t d, void* counts, void* sums) {
  dispatch_float(dtype, "code_statistics", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* count = static_cast<T*>(counts);
    T* sum = static_cast<T*>(sums);
    const T* rows = static_cast<const T*>(x);
    std::fill(count, count + k, T(0));
    std::fill(sum, sum + k * d, T(0));
    for (int64_t i = 0; i < n; ++i)
      if (idx[i] >= 0 && idx[i] < k) count[idx[i]] += T(1);
    if (d == 0) return;
    cpu::parallel_for(0, d, std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(1, n)),
                      [&](int64_t lo, int64_t hi) {
                        for (int64_t i = 0; i < n; ++i) {
                          const int64_t c = idx[i];
                          if (c < 0 || c >= k) continue;
                          T* out = sum + c * d;
                          const T* row = rows + i * d;
                          for (int64_t e = lo; e < hi; ++e) out[e] += row[e];
                        }
                      });
  });
}

void ema_lerp(DType dtype, int64_t n, double keep, double alpha, void* x, const void* a) {
  dispatch_float(dtype, "Codebook EMA", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* xs = static_cast<T*>(x);
    const T* as = static_cast<const T*>(a);
    const T k = static_cast<T>(keep), al = static_cast<T>(alpha);
    cpu::parallel_for(0, n, cpu::kGrainElements, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) xs[i] = fn::ema_lerp(xs[i], as[i], k, al);
    });
  });
}

void ema_embed(DType dtype, int64_t tables, int64_t k, int64_t d, double eps,
               const void* cluster_size, const void* totals, const void* embed_avg, void* embed) {
  dispatch_float(dtype, "Codebook EMA", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* sizes = static_cast<const T*>(cluster_size);
    const T* total = static_cast<const T*>(totals);
    const T* avg = static_cast<const T*>(embed_avg);
    T* out = static_cast<T*>(embed);
    const T e = static_cast<T>(eps), k_eps = static_cast<T>(double(k) * eps);
    cpu::parallel_for(0, tables * k,
                      std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(d, 1)),
                      [&](int64_t lo, int64_t hi) {
                        for (int64_t row = lo; row < hi; ++row) {
                          const T s = fn::smoothed_size(sizes[row], total[row / k], e, k_eps);
                          for (int64_t j = 0; j < d; ++j)
                            out[row * d + j] = quanta::fn::div_rn(avg[row * d + j], s);
                        }
                      });
  });
}

}  // namespace quanta::quant::quant_cpu
