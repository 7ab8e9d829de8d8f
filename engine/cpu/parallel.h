#pragma once
// Thread-parallel loops over index ranges (OpenMP when built with it).
#include <cstdint>
#include <functional>

namespace quanta {

/** Threads used by CPU kernels (OpenMP and Eigen). */
int num_threads();
/** Sets the CPU thread count (process-wide, like OMP_NUM_THREADS). */
void set_num_threads(int n);

namespace cpu {

/** Below this many elements a loop runs on one thread. */
inline constexpr int64_t kGrainElements = 32768;

/** Calls f(lo, hi) over chunks of [begin, end), in parallel when the range
 * holds more than `grain` items. */
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f);

}  // namespace cpu
}  // namespace quanta
