#include "train/run_device.h"

#include <stdexcept>

namespace quanta::train {

Device run_device(const std::string& value) {
  Device d;
  try {
    d = Device::parse(value);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("--device must be cpu, cuda, cuda:N, sim or sim:N, got '" + value +
                                "'");
  }
  if (d.is_cpu() || d.is_sim()) return d;
  if (!cuda_built())
    throw std::invalid_argument("--device " + value + ": this quanta was built without CUDA");
  const int visible = cuda_device_count();
  if (d.index >= visible)
    throw std::invalid_argument("--device " + value + ": " + std::to_string(visible) +
                                " CUDA devices are visible");
  return d;
}

}  // namespace quanta::train
