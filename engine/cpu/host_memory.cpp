// The CPU's device table: aligned host memory (from 64 KiB up out of the
// block cache, which keeps their pages touched; huge-page aligned and advised
// from 2 MiB) and memcpy.
#include <cstdlib>
#include <cstring>
#include <new>

#include "engine/cpu/block_cache.h"
#include "engine/device_backend.h"

namespace quanta::cpu {
namespace {
// 64 bytes: a cache line and the widest SIMD register Eigen may use.
constexpr std::size_t kAlignment = 64;
// Buffers from 64 KiB come from the block cache, reused with their pages
// already touched when a block of the size was freed (first-touch page faults
// on a fresh 64 MiB output otherwise cost more than the kernel that fills it:
// measured 78 ms with 4 KiB pages, 12 ms with 2 MiB pages, for a 2 ms memset;
// the main job's activations of 0.2-1.6 MiB faulted in again at every step
// from malloc).
void* allocate(std::size_t nbytes, int) {
  if (const std::size_t block = cached_block_size(nbytes)) return take_block(block);
  const std::size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) throw std::bad_alloc();
  return p;
}

void release(void* p, std::size_t nbytes, int) noexcept {
  if (const std::size_t block = cached_block_size(nbytes))
    give_back_block(p, block);
  else
    std::free(p);
}

void copy(void* dst, Device, const void* src, Device, std::size_t nbytes) {
  std::memcpy(dst, src, nbytes);
}

}  // namespace

const DeviceBackend& host_backend() {
  static const DeviceBackend b{
      .name = "cpu",
      .caps = {.channels_last_conv = true, .prefers_channels_last = true, .host_readable = true},
      .allocate = allocate,
      .release = release,
      .copy = copy,
  };
  return b;
}

}  // namespace quanta::cpu
