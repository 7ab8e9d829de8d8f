#pragma once
// The largest values the numeric settings of a run may take: far above any
// real run, low enough that the step, batch and size arithmetic in int64
// cannot overflow (a batch size clamped to 2^63 - 1 made `n + batch - 1`
// wrap, and a division by zero followed). The command-line flags
// (flag_checks.h) and the config files (config.cpp, classify.cpp) share them.
#include <algorithm>
#include <cstdint>
#include <thread>

namespace quanta::train {

inline constexpr int64_t kMaxSteps = int64_t{1} << 40;
inline constexpr int64_t kMaxEpochs = int64_t{1} << 20;
inline constexpr int64_t kMaxBatchSize = int64_t{1} << 30;
/** Image counts (--limit-*) and step intervals (--log-every, --eval-every). */
inline constexpr int64_t kMaxCount = int64_t{1} << 40;
/** Channels of a layer (--hidden, --dim). */
inline constexpr int64_t kMaxChannels = int64_t{1} << 16;
/** Ranks on one machine (--nproc, quanta launch -n). */
inline constexpr int64_t kMaxRanks = 1024;
/** --dist-timeout: a week, in seconds. */
inline constexpr int64_t kMaxDistTimeout = 7 * 24 * 3600;

/** CPU threads a config may hold (100000 crashed the thread pool). Not tied
 * to this machine: a checkpoint's config must load on a smaller one. */
inline constexpr int64_t kMaxThreads = 1024;

/** The most CPU threads --threads may ask for here: 4 per core, at most
 * kMaxThreads (kMaxThreads when the core count is unknown). */
inline int64_t max_threads() {
  const int64_t cores = std::thread::hardware_concurrency();
  return cores == 0 ? kMaxThreads : std::min<int64_t>(kMaxThreads, 4 * cores);
}

}  // namespace quanta::train
