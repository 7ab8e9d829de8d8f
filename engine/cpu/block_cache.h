#pragma once
// Freed large CPU buffers kept for reuse. A fresh multi-megabyte buffer costs
// its page faults on first touch, which for a 64 MiB elementwise output are
// worth more than the kernel that fills it; an op run in a loop (a training
// step) allocates the same sizes every time, so handing the same pages back
// removes that cost. This is the one process-wide mutable state of the
// engine besides the thread-local guards and the thread count: a bounded,
// mutex-guarded set of free blocks. Only blocks of at least 2 MiB are kept
// (smaller ones are cheap for malloc), at most 512 MiB in all, or
// QUANTA_CPU_CACHE_MB (read once; 0 turns the cache off). Builds with
// AddressSanitizer keep nothing, so a use after free is still reported.
#include <cstddef>

namespace quanta::cpu {

/** Blocks this size and larger are cached (2 MiB, a huge page). */
inline constexpr std::size_t kCachedBlockMin = std::size_t(2) << 20;

/** A cached block of exactly `bytes` (a multiple of kCachedBlockMin, aligned
 * to it), or nullptr when none is free. */
void* take_cached_block(std::size_t bytes);

/** Keeps a block of `bytes` that its owner no longer needs; false when the
 * cache is full or off (the caller then frees it). */
bool keep_cached_block(void* block, std::size_t bytes);

/** Bytes held by the cache now. */
std::size_t cached_block_bytes();

/** A kernel's scratch memory for one call. From 256 KiB up it is rounded
 * to whole cached blocks and comes from (and goes back to) the cache: a
 * kernel called every step (a convolution's im2col columns) then reuses the
 * same pages instead of faulting in fresh ones from malloc each call.
 * Smaller buffers are plain malloc. */
class ScratchBuffer {
 public:
  explicit ScratchBuffer(std::size_t bytes);
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t cached_bytes_ = 0;  // the block's size when it is a cached block
};

}  // namespace quanta::cpu
