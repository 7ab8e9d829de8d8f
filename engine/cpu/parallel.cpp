#include "engine/cpu/parallel.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/eigen.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace quanta {

int num_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_num_threads(int n) {
  if (n < 1)
    throw std::invalid_argument("[set_num_threads] need at least 1 thread, got " +
                                std::to_string(n));
#ifdef _OPENMP
  omp_set_num_threads(n);
#endif
}

namespace cpu {

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
#ifdef _OPENMP
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads > 1 && n > grain) {
    const int64_t chunks = std::min<int64_t>(threads, (n + grain - 1) / grain);
    const int64_t step = (n + chunks - 1) / chunks;
#pragma omp parallel for num_threads(chunks) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = begin + c * step;
      const int64_t hi = std::min(end, lo + step);
      if (lo < hi) f(lo, hi);
    }
    return;
  }
#endif
  (void)grain;
  f(begin, end);
}

}  // namespace cpu
}  // namespace quanta
