#include "engine/cpu/block_cache.h"

#include <algorithm>
#include <cstdlib>
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

struct Cache {
  std::mutex mutex;
  std::multimap<std::size_t, void*> free;  // size -> block
  std::size_t held = 0;
  std::size_t capacity = 0;

  Cache() {
    std::size_t mb = 512;
    if (const char* env = std::getenv("QUANTA_CPU_CACHE_MB")) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(env, &end, 10);
      if (end != env && *end == '\0') mb = static_cast<std::size_t>(v);
    }
    capacity = kSanitized ? 0 : mb << 20;
  }
};

Cache& cache() {
  // The documented process-wide state (see the header). Never destroyed, so
  // a tensor freed during static destruction still finds it; blocks held at
  // exit go back to the OS with the process.
  static Cache* c = new Cache;
  return *c;
}

}  // namespace

void* take_cached_block(std::size_t bytes) {
  Cache& c = cache();
  if (c.capacity == 0) return nullptr;
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.free.find(bytes);
  if (it == c.free.end()) return nullptr;
  void* block = it->second;
  c.free.erase(it);
  c.held -= bytes;
  return block;
}

bool keep_cached_block(void* block, std::size_t bytes) {
  Cache& c = cache();
  if (bytes < kCachedBlockMin || c.capacity == 0) return false;
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.held + bytes > c.capacity) return false;
  c.free.emplace(bytes, block);
  c.held += bytes;
  return true;
}

std::size_t cached_block_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.held;
}

ScratchBuffer::ScratchBuffer(std::size_t bytes) {
  constexpr std::size_t kFromCache = std::size_t(256) << 10;
  if (bytes >= kFromCache) {
    cached_bytes_ = (bytes + kCachedBlockMin - 1) / kCachedBlockMin * kCachedBlockMin;
    data_ = take_cached_block(cached_bytes_);
    if (!data_) data_ = std::aligned_alloc(kCachedBlockMin, cached_bytes_);
  } else {
    data_ = std::malloc(std::max<std::size_t>(bytes, 1));
  }
  if (!data_) throw std::bad_alloc();
}

ScratchBuffer::~ScratchBuffer() {
  if (cached_bytes_ > 0 && keep_cached_block(data_, cached_bytes_)) return;
  std::free(data_);
}

}  // namespace quanta::cpu
