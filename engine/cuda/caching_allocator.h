#pragma once
// Device memory through a cache, so that a training loop's steady state
// makes no cudaMalloc/cudaFree (each is a device-wide synchronisation, and
// costs more than most kernels). Freed blocks are kept per device and size
// class, and the next allocation of that class takes one back.
//
// Reuse is safe in stream order: every quanta kernel and copy runs on the
// device's default stream, so a kernel queued after a block was handed back
// runs after every kernel that used it before. (NCCL's own stream is joined
// before its collectives return.) A second stream would have to record its
// use of a block before the block could be reused.
//
// Host-only code, in libquanta: the raw device allocation it wraps comes
// from the CUDA module, and tests drive it with a fake one on the CPU.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "engine/device.h"

namespace quanta::cuda {

class CachingAllocator {
 public:
  /** The allocator underneath: malloc throws when the device has no room. */
  struct Raw {
    std::function<void*(std::size_t nbytes, int device)> malloc;
    std::function<void(void* ptr, int device)> free;
  };

  explicit CachingAllocator(Raw raw);
  /** Returns every cached block; blocks still held stay with their owners. */
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /** A block of at least `nbytes` (rounded up to its size class) on
   * `device`. When the device is out of memory, the device's cached blocks
   * are returned and the allocation tried once more (not while a pool is
   * open: a capture cannot wait for cudaFree); then it throws
   * std::runtime_error naming the size, the device and what is held. */
  void* allocate(std::size_t nbytes, int device);
  /** Hands a block from allocate() back to the cache. A pointer the cache
   * did not hand out is reported on stderr and passed to Raw::free. */
  void deallocate(void* ptr, int device) noexcept;

  /** Returns every cached (unused) block of every device to Raw::free
   * (a graph's pool keeps its own). */
  void empty_cache();

  /** Private pools, for graphs (engine/capture/device_graph.h): while a
   * pool is open on `device`, the blocks allocate() hands out there belong
   * to it until release_pool, wherever they came from, and a block of it
   * that is freed goes back to it, for its later allocations only: a
   * graph's replays write every block its capture was given, so nobody
   * else may have one. A block from before the pool opened that is freed
   * while it is open joins it too (the graph's kernels may use it at every
   * replay). Returns the pool's id. Throws std::logic_error when
   * one is open on `device` already. */
  uint64_t open_pool(int device);
  /** Allocations on `device` come from the shared cache again; the pool
   * keeps its blocks. */
  void close_pool(int device);
  /** The graph is gone: the pool's free blocks join the shared cache now,
   * its blocks still held when they are freed. */
  void release_pool(uint64_t pool);
  MemoryStats stats(int device) const;
  /** Peaks restart from the current figures. */
  void reset_peak_stats(int device);

  /** The bytes a request of `nbytes` really takes: at least 512, then four
   * classes per power of two, so at most a quarter more than asked. */
  static std::size_t size_class(std::size_t nbytes);

 private:
  using FreeBlocks = std::unordered_map<std::size_t, std::vector<void*>>;  // by size class
  struct DeviceCache {
    FreeBlocks free_blocks;
    std::unordered_map<void*, std::size_t> live;  // block -> size class
    MemoryStats stats;
    uint64_t open_pool = 0;  // allocations go to this pool (0: none)
  };
  struct Pool {
    int device = 0;
    FreeBlocks free_blocks;
  };
  DeviceCache& cache_of(int device);
  void release_cached(int device, DeviceCache& c);

  Raw raw_;
  mutable std::mutex mutex_;
  std::unordered_map<int, DeviceCache> devices_;
  std::unordered_map<uint64_t, Pool> pools_;
  std::unordered_map<void*, uint64_t> pool_of_;  // blocks of live pools, held or free
  uint64_t next_pool_ = 1;
};

}  // namespace quanta::cuda
