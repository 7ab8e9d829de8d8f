#pragma once
// Whether this test process can use a GPU, and the one-line reason when not
// (printed by every CUDA test that skips, so a CI log says why).
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cuda/module.h"
#include "engine/device.h"
#include "engine/tensor.h"

namespace quanta::testing {

inline bool have_gpu() { return cuda_device_count() > 0; }

inline std::string no_gpu_reason() {
  // "quanta was built without CUDA ...", "the CUDA backend could not be
  // loaded ...", or a loaded backend that sees no device.
  const std::string& why = cuda::unavailable_reason();
  return why.empty() ? "no CUDA device is visible" : why;
}

/** The devices a test runs its device cases on besides the CPU: sim:0
 * always (the host side of the GPU path, in every CI run, with the CPU's
 * bits), then cuda:0 where a GPU is visible. */
inline const std::vector<Device>& test_devices() {
  static const std::vector<Device> d = [] {
    std::vector<Device> v{Device::sim(0)};
    if (have_gpu()) v.push_back(Device::cuda(0));
    return v;
  }();
  return d;
}

/** The CPU, then test_devices(): what a test compares across devices. */
inline std::vector<Device> cpu_and_test_devices() {
  std::vector<Device> v{Device::cpu()};
  v.insert(v.end(), test_devices().begin(), test_devices().end());
  return v;
}

/** The typed address of t's element 0 on whatever device t lives, for tests
 * that hand device tensors to a kernel table directly (Tensor::data<T> is
 * for the CPU only, and says so when called on a GPU tensor). */
template <class T>
T* dev(const Tensor& t) {
  if (t.dtype() != dtype_v<T>)
    throw std::invalid_argument(std::string("[dev] tensor has dtype ") + dtype_name(t.dtype()) +
                                ", accessed as " + dtype_name(dtype_v<T>));
  return static_cast<T*>(t.raw_data());
}

}  // namespace quanta::testing
