#include "engine/storage.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "engine/cuda/runtime.h"

namespace quanta {
namespace {
// 64 bytes: a cache line and the widest SIMD register Eigen may use.
constexpr std::size_t kAlignment = 64;
}  // namespace

Storage::Storage(std::size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  if (nbytes == 0) return;  // zero-size tensors own no memory
  if (device.is_cpu()) {
    const std::size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    data_ = std::aligned_alloc(kAlignment, rounded);
    if (!data_) throw std::bad_alloc();
  } else {
    data_ = cuda::device_malloc(nbytes, device.index);
  }
}

Storage::~Storage() {
  if (!data_) return;
  if (device_.is_cpu()) {
    std::free(data_);
  } else {
    cuda::device_free(data_, device_.index);
  }
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                std::size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  cuda::copy(dst, dst_device, src, src_device, nbytes);
}

}  // namespace quanta
