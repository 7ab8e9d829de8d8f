// Stub CUDA backend for builds without nvcc: every entry point throws.
#include <stdexcept>

#include "engine/cuda/runtime.h"

namespace quanta {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }

namespace cuda {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string("[") + what +
                           "] quanta was built without CUDA (reconfigure with "
                           "-Dcuda=enabled on a machine with nvcc)");
}
}  // namespace

void* device_malloc(std::size_t, int) { no_cuda("cuda::device_malloc"); }
void device_free(void*, int) noexcept {}
void copy(void*, Device, const void*, Device, std::size_t) { no_cuda("cuda::copy"); }

}  // namespace cuda
}  // namespace quanta
