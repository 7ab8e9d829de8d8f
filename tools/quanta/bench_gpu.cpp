// The shared `--device cuda` bench helpers (bench_gpu.h).
#include "bench_gpu.h"

#include <exception>

#include "engine/cuda/runtime.h"

namespace quanta::cli {

void GpuTimer::sync() const { cuda::synchronize(device.index); }

std::vector<double> GpuTimer::time(const std::vector<std::function<void()>>& fns) const {
  return interleaved_ms(repeat, kGpuCalls, fns, [this] { sync(); });
}

BenchRow timed_row(double ms, double floor_ms) {
  BenchRow row;
  row.ms = ms;
  row.floor_ms = floor_ms;
  return row;
}

BenchRow row_or_error(const std::string& name, const std::function<BenchRow()>& measure) {
  try {
    BenchRow row = measure();
    row.name = name;
    return row;
  } catch (const std::exception& e) {
    return unavailable_row(name, e.what());
  }
}

}  // namespace quanta::cli
