// CUDA memory and copies. Issue 9 replaces device_malloc with a caching,
// stream-ordered allocator; the seam stays the same.
#include <stdexcept>
#include <string>

#include "engine/cuda/check.cuh"
#include "engine/cuda/runtime.h"

namespace quanta {

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  // No driver or no GPU is not an error here: it means zero devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

namespace cuda {
namespace {
void check_device(int device) {
  const int n = cuda_device_count();
  if (device < 0 || device >= n)
    throw std::runtime_error("[cuda] device cuda:" + std::to_string(device) +
                             " is not available (" + std::to_string(n) +
                             " CUDA devices visible)");
}
}  // namespace

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

void copy(void* dst, Device dst_device, const void* src, Device src_device,
          std::size_t nbytes) {
  cudaMemcpyKind kind = cudaMemcpyDefault;
  if (dst_device.is_cuda()) check_device(dst_device.index);
  if (src_device.is_cuda()) check_device(src_device.index);
  QUANTA_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, kind));
}

}  // namespace cuda
}  // namespace quanta
