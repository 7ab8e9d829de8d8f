#include "engine/cpu/block_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <string>

namespace quanta::cpu {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// How far in use plus kept may pass the peak in use: room for the blocks of
// the sizes a step's other phases take, kept while its peak phase runs (a
// Llama step's forward temporaries while its backward starts): half the peak,
// at least 512 MiB.
constexpr std::size_t kMinSlackBytes = std::size_t(512) << 20;

struct Cache {
  struct Kept {
    std::size_t bytes;
    void* block;
  };
  std::mutex mutex;
  std::list<Kept> kept;  // oldest first
  std::multimap<std::size_t, std::list<Kept>::iterator> by_size;
  std::size_t held = 0;    // bytes kept
  std::size_t in_use = 0;  // bytes of blocks handed out
  std::size_t peak = 0;    // the most in_use ever was
  bool on = true;
  bool fixed = false;         // QUANTA_CPU_CACHE_MB: a fixed bound on `held`
  std::size_t fixed_cap = 0;  // its bytes

  Cache() {
    if (const char* env = std::getenv("QUANTA_CPU_CACHE_MB")) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(env, &end, 10);
      if (end != env && *end == '\0') {
        fixed = true;
        fixed_cap = static_cast<std::size_t>(v) << 20;
        on = v > 0;
      }
    }
    if (kSanitized) on = false;
  }

  std::size_t bound() const { return peak + std::max(kMinSlackBytes, peak / 2); }

  void forget(std::list<Kept>::iterator it) {
    held -= it->bytes;
    kept.erase(it);
  }

  // Frees the blocks kept longest until `bytes` more in use stays within the
  // bound (the caller holds the mutex).
  void make_room(std::size_t bytes) {
    if (fixed) return;  // the fixed bound applies to kept blocks only
    const std::size_t limit = std::max(bound(), in_use + bytes);
    while (!kept.empty() && in_use + bytes + held > limit) {
      auto oldest = kept.begin();
      for (auto it = by_size.lower_bound(oldest->bytes); it != by_size.end(); ++it)
        if (it->second == oldest) {
          by_size.erase(it);
          break;
        }
      std::free(oldest->block);
      forget(oldest);
    }
  }
};

Cache& cache() {
  // The documented process-wide state (see the header). Never destroyed, so
  // a tensor freed during static destruction still finds it; blocks held at
  // exit go back to the OS with the process.
  static Cache* c = new Cache;
  return *c;
}

void* fresh_block(std::size_t bytes) {
  constexpr std::size_t kPage = 4096;
  const bool huge = bytes >= kHugeBlock;
  void* p = std::aligned_alloc(huge ? kHugeBlock : kPage, bytes);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);  // advice only
#endif
  return p;
}

}  // namespace

void* take_block(std::size_t bytes) {
  Cache& c = cache();
  if (!c.on) return fresh_block(bytes);
  std::lock_guard<std::mutex> lock(c.mutex);
  void* block = nullptr;
  if (auto it = c.by_size.find(bytes); it != c.by_size.end()) {
    block = it->second->block;
    c.forget(it->second);
    c.by_size.erase(it);
  } else {
    c.make_room(bytes);
    block = fresh_block(bytes);
  }
  c.in_use += bytes;
  c.peak = std::max(c.peak, c.in_use);
  return block;
}

void give_back_block(void* block, std::size_t bytes) noexcept {
  Cache& c = cache();
  if (!c.on) {
    std::free(block);
    return;
  }
  std::lock_guard<std::mutex> lock(c.mutex);
  c.in_use -= bytes;
  // In use plus kept stays as it was, within the bound; a fixed bound caps
  // the kept bytes alone.
  if (c.fixed && c.held + bytes > c.fixed_cap) {
    std::free(block);
    return;
  }
  // No memory for the bookkeeping (a release must not throw): free the block.
  try {
    c.kept.push_back({bytes, block});
  } catch (const std::bad_alloc&) {
    std::free(block);
    return;
  }
  try {
    c.by_size.emplace(bytes, std::prev(c.kept.end()));
  } catch (const std::bad_alloc&) {
    c.kept.pop_back();
    std::free(block);
    return;
  }
  c.held += bytes;
}

std::size_t cached_block_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.held;
}

std::size_t release_cached_blocks() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const std::size_t freed = c.held;
  for (const Cache::Kept& k : c.kept) std::free(k.block);
  c.kept.clear();
  c.by_size.clear();
  c.held = 0;
  return freed;
}

BlockCacheStats block_cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const std::size_t bound = !c.on ? 0 : c.fixed ? c.in_use + c.fixed_cap : c.bound();
  return {.held = c.held, .in_use = c.in_use, .peak = c.peak, .bound = bound};
}

ScratchBuffer::ScratchBuffer(std::size_t bytes) {
  block_bytes_ = cached_block_size(bytes);
  if (block_bytes_ > 0) {
    data_ = take_block(block_bytes_);
  } else {
    data_ = std::malloc(std::max<std::size_t>(bytes, 1));
    if (!data_) throw std::bad_alloc();
  }
}

ScratchBuffer::~ScratchBuffer() {
  if (block_bytes_ > 0)
    give_back_block(data_, block_bytes_);
  else
    std::free(data_);
}

}  // namespace quanta::cpu
