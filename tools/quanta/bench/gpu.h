#pragma once
// What the `--device cuda` bench rows share (engine_cuda.cpp,
// quant_cuda.cpp, bench_nf4_cuda.cpp): timing on a GPU in turns with
// a floor, each batch of calls ended by cuda::synchronize so that it counts
// the device's work and not only the launches, and rows that report an op's
// error instead of failing the suite.
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "bench.h"
#include "engine/device.h"

namespace quanta::cli {

/** Calls per timed batch: on a GPU a batch must outlast the synchronisation
 * that ends it. */
inline constexpr int kGpuCalls = 20;

/** Times functions on one GPU. */
struct GpuTimer {
  Device device;
  int repeat = 5;
  /** Waits until the device's queued work is done. */
  void sync() const;
  /** Per-call median milliseconds of each of `fns`, timed in turns
   * (interleaved_ms with kGpuCalls calls per batch, each batch synced). */
  std::vector<double> time(const std::vector<std::function<void()>>& fns) const;
  /** `op` timed in turns with its memory floor: a device-to-device copy
   * that moves `bytes_moved` bytes (reads and writes half of them each). */
  BenchRow against_copy(const std::function<void()>& op, std::size_t bytes_moved) const;
};

/** A measured row: ms against floor_ms (the name is set by row_or_error). */
BenchRow timed_row(double ms, double floor_ms);

/** The row `measure` returns, named `name`, or an unavailable row with the
 * error it threw (an op without a kernel, a dtype cuBLAS refuses, memory). */
BenchRow row_or_error(const std::string& name, const std::function<BenchRow()>& measure);

}  // namespace quanta::cli
