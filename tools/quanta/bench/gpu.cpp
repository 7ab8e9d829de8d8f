// The shared `--device cuda` bench helpers (gpu.h).
#include "gpu.h"

#include <exception>

#include "engine/cuda/runtime.h"
#include "engine/factory.h"

namespace quanta::cli {

void GpuTimer::sync() const { cuda::synchronize(device.index); }

std::vector<double> GpuTimer::time(const std::vector<std::function<void()>>& fns) const {
  return interleaved_ms(repeat, kGpuCalls, fns, [this] { sync(); });
}

BenchRow GpuTimer::against_copy(const std::function<void()>& op, std::size_t bytes_moved) const {
  const auto half = static_cast<int64_t>(bytes_moved / 2);
  const Tensor src = zeros({half}, {.dtype = DType::u8, .device = device});
  const Tensor dst = zeros({half}, {.dtype = DType::u8, .device = device});
  const std::vector<double> ms = time({op, [&] {
                                         cuda::copy(dst.raw_data(), device, src.raw_data(), device,
                                                    static_cast<std::size_t>(half));
                                       }});
  return timed_row(ms[0], ms[1]);
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
