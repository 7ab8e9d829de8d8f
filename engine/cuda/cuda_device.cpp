// CUDA's device table in libquanta: memory and copies forwarded to the CUDA
// module (engine/cuda/module.cpp), which throws naming what is missing when
// it cannot be loaded.
#include "engine/cuda/runtime.h"
#include "engine/device_backend.h"

namespace quanta::cuda {
namespace {

void* allocate(std::size_t nbytes, int index) { return device_malloc(nbytes, index); }
void release(void* p, std::size_t, int index) noexcept { device_free(p, index); }

}  // namespace

const DeviceBackend& backend() {
  // The CUDA convolutions take channels first (ops permute NHWC around them).
  static const DeviceBackend b{
      .name = "cuda",
      .caps = {.channels_last_conv = false, .fused_add_n = false, .host_readable = false},
      .allocate = allocate,
      .release = release,
      .copy = copy,
  };
  return b;
}

}  // namespace quanta::cuda
