#include "train/run_device.h"

#include <stdexcept>

#include "dist/env.h"

namespace quanta::train {

Device rank_device(const std::string& value, Device parsed, int local_rank) {
  if (value == "cuda" && parsed.is_cuda()) return Device::cuda(local_rank);
  return parsed;
}

Device run_device(const std::string& value, int local_rank) {
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
  d = rank_device(value, d, local_rank);
  const int visible = cuda_device_count();
  if (d.index >= visible) {
    if (value == "cuda" && local_rank > 0)
      throw std::invalid_argument("--device cuda: local rank " + std::to_string(local_rank) +
                                  " takes GPU " + std::to_string(d.index) + ", but " +
                                  std::to_string(visible) +
                                  " CUDA devices are visible (one GPU per rank: start at most " +
                                  std::to_string(visible) + " ranks on this node)");
    throw std::invalid_argument("--device " + value + ": " + std::to_string(visible) +
                                " CUDA devices are visible");
  }
  return d;
}

Device run_device(const std::string& value) {
  return run_device(value, dist::launch_info_from_env().local_rank);
}

}  // namespace quanta::train
