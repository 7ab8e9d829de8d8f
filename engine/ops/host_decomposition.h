#pragma once
// What the host-side matrix decompositions (svd.cpp, qr.cpp) share: a
// matrix's entries checked finite before Eigen sees them, and several
// decompositions run on the CPU's threads, one matrix each (Eigen's
// decompositions are themselves sequential). Internal to engine/ops.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cpu/parallel.h"

namespace quanta::host_decomposition {

/** Throws std::invalid_argument "[who] entry (i, j) of the [m, n] matrix is
 * not finite" for the first such entry of the row-major values. */
template <typename T>
void check_finite(const std::vector<T>& values, int64_t m, int64_t n, const char* who) {
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i]))
      throw std::invalid_argument(
          std::string("[") + who + "] entry (" + std::to_string(int64_t(i) / n) + ", " +
          std::to_string(int64_t(i) % n) + ") of the [" + std::to_string(m) + ", " +
          std::to_string(n) + "] matrix is not finite");
}

/** Calls run(job) for every job, the jobs spread over the CPU's threads. */
template <typename Job, typename Run>
void run_on_threads(std::vector<Job>& jobs, const Run& run) {
  cpu::parallel_for(0, int64_t(jobs.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) run(jobs[std::size_t(i)]);
  });
}

}  // namespace quanta::host_decomposition
