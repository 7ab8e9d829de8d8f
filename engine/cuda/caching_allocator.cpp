#include "engine/cuda/caching_allocator.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>

namespace quanta::cuda {
namespace {

constexpr std::size_t kMinBlock = 512;  // cudaMalloc aligns to 256; 512 keeps classes few

// "7168 bytes", "3.0 MiB", "1.50 GiB".
std::string size_str(std::size_t bytes) {
  char buf[48];
  const double b = static_cast<double>(bytes);
  if (bytes < (std::size_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  else if (bytes < (std::size_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  return buf;
}

void raise_peaks(MemoryStats& s) {
  s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, s.allocated_bytes);
  s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
}

}  // namespace

std::size_t CachingAllocator::size_class(std::size_t nbytes) {
  if (nbytes <= kMinBlock) return kMinBlock;
  if (nbytes > (std::size_t(-1) >> 2)) return nbytes;  // no device has that: let malloc say so
  // Four classes per power of two: (n - 1) has its top bit at 2^k, the step
  // is 2^(k-2), and n is rounded up to a multiple of it.
  const int k = std::bit_width(nbytes - 1) - 1;
  const std::size_t step = std::size_t(1) << (k - 2);
  return (nbytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator(Raw raw) : raw_(std::move(raw)) {}

CachingAllocator::~CachingAllocator() { empty_cache(); }

CachingAllocator::DeviceCache& CachingAllocator::cache_of(int device) { return devices_[device]; }

void CachingAllocator::release_cached(int device, DeviceCache& c) {
  for (auto& [size, blocks] : c.free_blocks) {
    for (void* p : blocks) {
      raw_.free(p, device);
      c.stats.reserved_bytes -= size;
      ++c.stats.device_frees;
    }
  }
  c.free_blocks.clear();
}

namespace {
// A free block of `size` from `blocks`, or null.
void* take(std::unordered_map<std::size_t, std::vector<void*>>& blocks, std::size_t size) {
  const auto it = blocks.find(size);
  if (it == blocks.end()) return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  // No empty lists: an empty map is an empty cache (the out-of-memory retry
  // reads it so).
  if (it->second.empty()) blocks.erase(it);
  return p;
}
}  // namespace

void* CachingAllocator::allocate(std::size_t nbytes, int device) {
  const std::size_t size = size_class(nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceCache& c = cache_of(device);
  ++c.stats.allocations;
  void* p = nullptr;
  // An open pool's own free blocks first (freed earlier in the capture).
  if (c.open_pool) p = take(pools_.at(c.open_pool).free_blocks, size);
  if (!p) p = take(c.free_blocks, size);
  if (p) {
    ++c.stats.cache_hits;
  } else {
    try {
      p = raw_.malloc(size, device);
    } catch (const std::exception& first) {
      // Blocks of other classes may be what the device lacks: return them
      // and try once more before giving up. Not while a graph is being
      // captured: cudaFree would wait for the device, which a capture
      // cannot.
      if (c.open_pool || c.free_blocks.empty()) throw;
      ++c.stats.oom_retries;
      const std::size_t cached = c.stats.reserved_bytes - c.stats.allocated_bytes;
      release_cached(device, c);
      try {
        p = raw_.malloc(size, device);
      } catch (const std::exception& second) {
        throw std::runtime_error(
            "[cuda] out of memory: " + size_str(size) + " on cuda:" + std::to_string(device) +
            " with " + size_str(c.stats.allocated_bytes) + " held by tensors (" + size_str(cached) +
            " of cached blocks returned first): " + second.what());
      }
    }
    ++c.stats.device_mallocs;
    c.stats.reserved_bytes += size;
  }
  c.live.emplace(p, size);
  if (c.open_pool) pool_of_[p] = c.open_pool;
  c.stats.allocated_bytes += size;
  raise_peaks(c.stats);
  return p;
}

void CachingAllocator::deallocate(void* ptr, int device) noexcept {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceCache& c = cache_of(device);
  const auto it = c.live.find(ptr);
  if (it == c.live.end()) {
    std::fprintf(stderr,
                 "[cuda] freeing %p on cuda:%d, which the caching allocator did not hand "
                 "out; passing it to cudaFree\n",
                 ptr, device);
    raw_.free(ptr, device);
    return;
  }
  const std::size_t size = it->second;
  c.live.erase(it);
  c.stats.allocated_bytes -= size;
  if (const auto pool = pool_of_.find(ptr); pool != pool_of_.end()) {
    pools_.at(pool->second).free_blocks[size].push_back(ptr);  // the graph's still
    return;
  }
  if (c.open_pool) {
    // A block from before the capture, freed during it: the graph's kernels
    // may still read or write it at every replay, so it joins the graph's
    // pool rather than the shared cache, where work outside the graph
    // could be given it.
    pool_of_[ptr] = c.open_pool;
    pools_.at(c.open_pool).free_blocks[size].push_back(ptr);
    return;
  }
  c.free_blocks[size].push_back(ptr);
}

uint64_t CachingAllocator::open_pool(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceCache& c = cache_of(device);
  if (c.open_pool)
    throw std::logic_error("[cuda] a graph's memory pool is already open on cuda:" +
                           std::to_string(device));
  const uint64_t id = next_pool_++;
  pools_[id].device = device;
  c.open_pool = id;
  return id;
}

void CachingAllocator::close_pool(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  cache_of(device).open_pool = 0;
}

void CachingAllocator::release_pool(uint64_t pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = pools_.find(pool);
  if (it == pools_.end()) return;
  DeviceCache& c = cache_of(it->second.device);
  if (c.open_pool == pool) c.open_pool = 0;
  for (auto& [size, blocks] : it->second.free_blocks)
    for (void* p : blocks) c.free_blocks[size].push_back(p);
  for (auto b = pool_of_.begin(); b != pool_of_.end();)
    b = b->second == pool ? pool_of_.erase(b) : std::next(b);
  pools_.erase(it);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [device, c] : devices_) release_cached(device, c);
}

MemoryStats CachingAllocator::stats(int device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = devices_.find(device);
  return it == devices_.end() ? MemoryStats{} : it->second.stats;
}

void CachingAllocator::reset_peak_stats(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  MemoryStats& s = cache_of(device).stats;
  s.peak_allocated_bytes = s.allocated_bytes;
  s.peak_reserved_bytes = s.reserved_bytes;
}

}  // namespace quanta::cuda
