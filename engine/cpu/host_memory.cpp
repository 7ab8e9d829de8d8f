// The CPU's device table: aligned host memory (huge-page aligned and advised
// for large buffers, whose pages a block cache keeps touched) and memcpy.
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "engine/cpu/block_cache.h"
#include "engine/device_backend.h"

namespace quanta::cpu {
namespace {
// 64 bytes: a cache line and the widest SIMD register Eigen may use.
constexpr std::size_t kAlignment = 64;
// Large buffers are aligned to a huge page and advised to use huge pages:
// first-touch page faults on a fresh 64 MiB output otherwise cost more than
// the kernel that fills it (measured: 78 ms with 4 KiB pages, 12 ms with
// 2 MiB pages, for a 2 ms memset).
constexpr std::size_t kHugePage = std::size_t(2) << 20;

void* allocate(std::size_t nbytes, int) {
  const std::size_t align = nbytes >= kHugePage ? kHugePage : kAlignment;
  const std::size_t rounded = (nbytes + align - 1) / align * align;
  // Large blocks: pages already touched by an earlier tensor of this size
  // when the cache has one (cpu/block_cache.h says why).
  if (align == kHugePage)
    if (void* p = take_cached_block(rounded)) return p;
  void* p = std::aligned_alloc(align, rounded);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice only
#endif
  return p;
}

void release(void* p, std::size_t nbytes, int) noexcept {
  const std::size_t rounded = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
  if (nbytes >= kHugePage && keep_cached_block(p, rounded)) return;
  std::free(p);
}

void copy(void* dst, Device, const void* src, Device, std::size_t nbytes) {
  std::memcpy(dst, src, nbytes);
}

}  // namespace

const DeviceBackend& host_backend() {
  static const DeviceBackend b{
      .name = "cpu",
      .caps = {.channels_last_conv = true, .host_readable = true},
      .allocate = allocate,
      .release = release,
      .copy = copy,
  };
  return b;
}

}  // namespace quanta::cpu
