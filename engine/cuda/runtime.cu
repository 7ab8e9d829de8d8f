// CUDA memory and copies, and the module's one exported entry point
// (engine/cuda/module.h): libquanta reaches everything in libquanta_cuda
// through quanta_cuda_module_v1. A caching, stream-ordered allocator
// (issue 17) replaces device_malloc behind the same seam.
#include <stdexcept>
#include <string>

#include "engine/cuda/check.cuh"
#include "engine/cuda/module.h"
#include "engine/kernels/table.h"

namespace quanta::cuda {
namespace {

int device_count() {
  int n = 0;
  // No driver or no GPU is not an error here: it means zero devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void check_device(int device) {
  const int n = device_count();
  if (device < 0 || device >= n)
    throw std::runtime_error("[cuda] device cuda:" + std::to_string(device) +
                             " is not available (" + std::to_string(n) + " CUDA devices visible)");
}

void set_device(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
  check_device(device);
  QUANTA_CUDA_CHECK(cudaSetDevice(device));
}

void* device_malloc(std::size_t nbytes, int device) {
  check_device(device);
  QUANTA_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  QUANTA_CUDA_CHECK(cudaMalloc(&p, nbytes));
  return p;
}

void device_free(void* ptr, int device) noexcept {
  cudaSetDevice(device);
  cudaFree(ptr);
}

void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t nbytes) {
  if (dst_device.is_cuda()) check_device(dst_device.index);
  if (src_device.is_cuda()) check_device(src_device.index);
  QUANTA_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault));
}

}  // namespace
}  // namespace quanta::cuda

extern "C" __attribute__((visibility("default"))) const quanta::cuda::Module*
quanta_cuda_module_v1() {
  using namespace quanta::cuda;
  static const Module m{
      .abi = Module::kAbi,
      .device_count = device_count,
      .device_malloc = device_malloc,
      .device_free = device_free,
      .set_device = set_device,
      .copy = copy,
      .kernels = cuda_kernels,
  };
  return &m;
}
