// The CPU's row reductions: each output reduces one contiguous row.
#include <Eigen/Core>
#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "engine/cpu/convert.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"

namespace quanta::cpu {
namespace {

// Sum of n contiguous values; long rows are split across threads.
template <class T, class Acc>
Acc row_sum(const T* p, int64_t n, bool parallel) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  if (!parallel || n <= kGrainElements) {
    if constexpr (std::is_floating_point_v<T>) {
      return static_cast<Acc>(Eigen::Map<const Arr>(p, n).sum());
    } else {
      Acc s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<Acc>(p[i]);
      return s;
    }
  }
  const int threads = std::max(1, num_threads());
  std::vector<Acc> partial(threads, Acc(0));
  const int64_t step = (n + threads - 1) / threads;
  parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t b = c * step, e = std::min(n, b + step);
      if (b < e) partial[c] = row_sum<T, Acc>(p + b, e - b, false);
    }
  });
  Acc s = 0;
  for (Acc v : partial) s += v;
  return s;
}

}  // namespace

void reduce_rows(RowReduce, DType in_dtype, const void* rows, int64_t outer, int64_t inner,
                 void* out) {
  dispatch_all(in_dtype, "sum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (is_half_v<T>) {
      throw std::logic_error("[sum] 16-bit input reached the kernel");
    } else {
      using O = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
      const T* in = static_cast<const T*>(rows);
      O* o = static_cast<O*>(out);
      if (outer == 1) {
        o[0] = row_sum<T, O>(in, inner, true);
      } else {
        parallel_for(0, outer, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)),
                     [&](int64_t lo, int64_t hi) {
          for (int64_t r = lo; r < hi; ++r) o[r] = row_sum<T, O>(in + r * inner, inner, false);
        });
      }
    }
  });
}

}  // namespace quanta::cpu
