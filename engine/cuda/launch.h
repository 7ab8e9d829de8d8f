#pragma once
// Launch geometry for grid-stride kernels, computed on the host. Plain C++ so
// the CPU tests check it; the CUDA kernels and this header agree on
// kThreadsPerBlock.
#include <algorithm>
#include <cstdint>

namespace quanta::cuda {

inline constexpr int kThreadsPerBlock = 256;

struct LaunchConfig {
  int64_t blocks = 0;  // 0: nothing to launch
  int threads = kThreadsPerBlock;
};

/** Blocks for `n` elements of a grid-stride loop: enough to cover n, at most
 * `max_blocks` (a few waves of the device's multiprocessors: more only adds
 * scheduling work, each thread loops over the rest). 0 blocks for n <= 0. */
inline LaunchConfig launch_config(int64_t n, int64_t max_blocks) {
  LaunchConfig c;
  if (n <= 0) return c;
  const int64_t needed = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  c.blocks = std::max<int64_t>(1, std::min(needed, max_blocks));
  return c;
}

}  // namespace quanta::cuda
