#pragma once
// Whether this test process can use a GPU, and the one-line reason when not
// (printed by every CUDA test that skips, so a CI log says why).
#include <string>

#include "engine/device.h"

namespace quanta::testing {

inline bool have_gpu() { return cuda_device_count() > 0; }

inline std::string no_gpu_reason() {
  return cuda_built() ? "no CUDA device is visible" : "quanta was built without CUDA";
}

}  // namespace quanta::testing
