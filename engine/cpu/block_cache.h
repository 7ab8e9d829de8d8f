#pragma once
// Freed large CPU buffers kept for reuse. A fresh multi-megabyte buffer costs
// its page faults on first touch, which for a 64 MiB elementwise output are
// worth more than the kernel that fills it; an op run in a loop (a training
// step) allocates the same sizes every time, so handing the same pages back
// removes that cost. This is the one process-wide mutable state of the
// engine besides the thread-local guards and the thread count: a bounded,
// mutex-guarded set of free blocks.
//
// Blocks of 64 KiB and more go through it: from 2 MiB up rounded to whole
// huge pages, below that to 64 KiB. Smaller ones are malloc's, which keeps
// them in its heap; the mid sizes were not cheap for malloc after all: glibc
// maps and unmaps them, or trims its heap's top, so that every step of the
// main job (activations of 0.2 to 1.6 MiB) faulted their pages in again
// (342,600 page faults in 300 steps, docs/performance.md). The bound: blocks in use plus blocks
// kept never exceed the most that were ever in use at once by more than half of it (at least 512
// MiB). So the cache keeps a whole training step's blocks (a Llama step's exceed 512 MiB: without
// them every step faulted its pages in again, 25-30% of its time, docs/performance.md) and never
// makes the process hold more than 1.5x its own peak: a fresh block that would pass the bound first
// frees the blocks kept longest. QUANTA_CPU_CACHE_MB (read once) sets a fixed bound on the blocks
// kept instead (at most that many MiB, whatever is in use); 0 turns the cache off. Builds with
// AddressSanitizer keep nothing, so a use after free is still reported.
#include <cstddef>

namespace quanta::cpu {

/** A huge page: blocks this size and larger are whole huge pages, aligned to
 * one and advised to use them. */
inline constexpr std::size_t kHugeBlock = std::size_t(2) << 20;
/** Blocks this size and larger go through the cache; smaller ones also come
 * in multiples of it. */
inline constexpr std::size_t kCachedBlockMin = std::size_t(64) << 10;

/** The size of the cached block a buffer of `bytes` takes: 0 below
 * kCachedBlockMin (malloc's business), else `bytes` rounded up to a
 * multiple of kCachedBlockMin, or of kHugeBlock from kHugeBlock up. */
constexpr std::size_t cached_block_size(std::size_t bytes) {
  if (bytes < kCachedBlockMin) return 0;
  const std::size_t unit = bytes < kHugeBlock ? kCachedBlockMin : kHugeBlock;
  return (bytes + unit - 1) / unit * unit;
}

/** A block of `bytes` (a size cached_block_size gives): a kept block of
 * exactly that size when one is free (its pages already touched), else a
 * fresh one, aligned to a page, or to a huge page and advised to use huge
 * pages from kHugeBlock up. Throws std::bad_alloc when memory runs out. */
void* take_block(std::size_t bytes);

/** Gives back a block from take_block(bytes): kept for reuse, or freed when
 * the cache is off or (with QUANTA_CPU_CACHE_MB) full. */
void give_back_block(void* block, std::size_t bytes) noexcept;

/** Bytes of free blocks the cache holds now. */
std::size_t cached_block_bytes();

/** Frees every block the cache holds (what a program that is done with a
 * large phase calls to hand the memory back to the system); returns the
 * bytes freed. Blocks in use are untouched and come back to the cache. */
std::size_t release_cached_blocks();

/** The cache's figures, for diagnostics and tests. */
struct BlockCacheStats {
  std::size_t held = 0;    // free blocks kept
  std::size_t in_use = 0;  // blocks from take_block not given back
  std::size_t peak = 0;    // the most in_use ever was
  std::size_t bound = 0;   // in_use + held stays within it (0: the cache is off)
};
BlockCacheStats block_cache_stats();

/** A kernel's scratch memory for one call: a cached block where
 * cached_block_size gives one, so that a kernel called every step (a
 * convolution's im2col columns) reuses the same pages instead of faulting in
 * fresh ones each call; smaller buffers are plain malloc. */
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
  std::size_t block_bytes_ = 0;  // the block's size when it came from take_block
};

}  // namespace quanta::cpu
