#pragma once
// Whether this test process can use a GPU, and the one-line reason when not
// (printed by every CUDA test that skips, so a CI log says why).
#include <string>

#include "engine/cuda/module.h"
#include "engine/device.h"

namespace quanta::testing {

inline bool have_gpu() { return cuda_device_count() > 0; }

inline std::string no_gpu_reason() {
  // "quanta was built without CUDA ...", "the CUDA backend could not be
  // loaded ...", or a loaded backend that sees no device.
  const std::string& why = cuda::unavailable_reason();
  return why.empty() ? "no CUDA device is visible" : why;
}

}  // namespace quanta::testing
