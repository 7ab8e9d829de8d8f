#include "engine/storage.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "engine/cpu/block_cache.h"
#include "engine/cuda/runtime.h"

namespace quanta {
namespace {
// 64 bytes: a cache line and the widest SIMD register Eigen may use.
constexpr std::size_t kAlignment = 64;
// Large buffers are aligned to a huge page and advised to use huge pages:
// first-touch page faults on a fresh 64 MiB output otherwise cost more than
// the kernel that fills it (measured: 78 ms with 4 KiB pages, 12 ms with
// 2 MiB pages, for a 2 ms memset).
constexpr std::size_t kHugePage = std::size_t(2) << 20;
}  // namespace

Storage::Storage(std::size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  if (nbytes == 0) return;  // zero-size tensors own no memory
  if (device.is_cpu()) {
    const std::size_t align = nbytes >= kHugePage ? kHugePage : kAlignment;
    const std::size_t rounded = (nbytes + align - 1) / align * align;
    // Large blocks: pages already touched by an earlier tensor of this size
    // when the cache has one (cpu/block_cache.h says why).
    if (align == kHugePage) data_ = cpu::take_cached_block(rounded);
    if (data_) return;
    data_ = std::aligned_alloc(align, rounded);
    if (!data_) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (align == kHugePage) madvise(data_, rounded, MADV_HUGEPAGE);  // advice only
#endif
  } else {
    data_ = cuda::device_malloc(nbytes, device.index);
  }
}

Storage::~Storage() {
  if (!data_) return;
  if (device_.is_cpu()) {
    const std::size_t rounded = (nbytes_ + kHugePage - 1) / kHugePage * kHugePage;
    if (nbytes_ >= kHugePage && cpu::keep_cached_block(data_, rounded)) return;
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
