// The CUDA caching allocator's bookkeeping, on the CPU: a fake device whose
// malloc counts calls and fails past a budget stands in for cudaMalloc.
#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cuda/caching_allocator.h"
#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;
using quanta::cuda::CachingAllocator;

namespace {

struct FakeDevice {
  std::size_t budget = std::size_t(1) << 30;
  std::size_t used = 0;
  int mallocs = 0, frees = 0;
  std::map<void*, std::size_t> blocks;

  CachingAllocator::Raw raw() {
    return {
        .malloc =
            [this](std::size_t n, int device) {
              if (used + n > budget)
                throw std::runtime_error("fake cuda:" + std::to_string(device) + ": out of memory");
              void* p = std::malloc(n);
              blocks[p] = n;
              used += n;
              ++mallocs;
              return p;
            },
        .free =
            [this](void* p, int) {
              REQUIRE(blocks.count(p) == 1);
              used -= blocks[p];
              blocks.erase(p);
              std::free(p);
              ++frees;
            },
    };
  }
};

}  // namespace

TEST_CASE("caching allocator: size classes are at least 512 bytes and at most 25% over") {
  CHECK(CachingAllocator::size_class(0) == 512);
  CHECK(CachingAllocator::size_class(1) == 512);
  CHECK(CachingAllocator::size_class(512) == 512);
  CHECK(CachingAllocator::size_class(513) == 640);  // 512 + 128
  CHECK(CachingAllocator::size_class(1000) == 1024);
  CHECK(CachingAllocator::size_class(1025) == 1280);
  CHECK(CachingAllocator::size_class(1500) == 1536);
  CHECK(CachingAllocator::size_class(std::size_t(3) << 20) == std::size_t(3) << 20);
  for (std::size_t n = 1; n < (std::size_t(1) << 22); n = n * 3 / 2 + 7) {
    const std::size_t c = CachingAllocator::size_class(n);
    INFO(n << " -> " << c);
    CHECK(c >= n);
    CHECK(c % 128 == 0);
    CHECK((c <= 512 || c * 4 <= n * 5 + 4 * 128));
    CHECK(CachingAllocator::size_class(c) == c);  // a class is its own class
  }
}

TEST_CASE("caching allocator: a steady loop mallocs once per block, then only reuses") {
  FakeDevice dev;
  {
    CachingAllocator a(dev.raw());
    for (int step = 0; step < 10; ++step) {
      void* x = a.allocate(4000, 0);
      void* y = a.allocate(100, 0);
      void* z = a.allocate(4000, 0);  // same class as x while x is live: a second block
      CHECK(x != z);
      a.deallocate(y, 0);
      a.deallocate(x, 0);
      a.deallocate(z, 0);
    }
    CHECK(dev.mallocs == 3);
    CHECK(dev.frees == 0);
    const MemoryStats s = a.stats(0);
    CHECK(s.allocations == 30);
    CHECK(s.cache_hits == 27);
    CHECK(s.device_mallocs == 3);
    CHECK(s.allocated_bytes == 0);
    CHECK(s.reserved_bytes == 2 * 4096 + 512);
    CHECK(s.peak_allocated_bytes == 2 * 4096 + 512);
    CHECK(a.stats(1).allocations == 0);  // devices are kept apart
    a.empty_cache();
    CHECK(dev.frees == 3);
    CHECK(a.stats(0).reserved_bytes == 0);
    CHECK(a.stats(0).device_frees == 3);
    CHECK(a.stats(0).peak_reserved_bytes == 2 * 4096 + 512);
    a.reset_peak_stats(0);
    CHECK(a.stats(0).peak_reserved_bytes == 0);
  }
  CHECK(dev.blocks.empty());
}

TEST_CASE("caching allocator: out of memory returns the cache and retries once") {
  FakeDevice dev;
  dev.budget = 10000;
  CachingAllocator a(dev.raw());
  void* big = a.allocate(6000, 0);    // class 6144
  a.deallocate(big, 0);               // cached: the device now has 3856 free
  void* other = a.allocate(7000, 0);  // class 7168: fits only once the cache is returned
  CHECK(other != nullptr);
  CHECK(a.stats(0).oom_retries == 1);
  CHECK(a.stats(0).device_frees == 1);
  CHECK(a.stats(0).reserved_bytes == 7168);
  // Nothing cached left to return: the error names the size and the device.
  CHECK_THROWS_WITH_AS(a.allocate(7000, 0), doctest::Contains("fake cuda:0: out of memory"),
                       std::runtime_error);
  void* small = a.allocate(600, 0);
  a.deallocate(small, 0);  // 640 cached
  CHECK_THROWS_WITH_AS(a.allocate(7000, 0),
                       doctest::Contains("[cuda] out of memory: 7168 bytes on cuda:0 with 7168 "
                                         "bytes held by tensors (640 bytes of cached blocks "
                                         "returned first)"),
                       std::runtime_error);
  a.deallocate(other, 0);
  CHECK(a.stats(0).allocated_bytes == 0);
}

TEST_CASE("caching allocator: out of memory with nothing cached is the device's error, no retry") {
  FakeDevice dev;
  dev.budget = 10000;
  CachingAllocator a(dev.raw());
  a.deallocate(a.allocate(6000, 0), 0);
  void* again = a.allocate(6000, 0);  // the cached block: its size's list is now empty
  CHECK_THROWS_WITH_AS(a.allocate(7000, 0), doctest::Contains("fake cuda:0: out of memory"),
                       std::runtime_error);
  CHECK(a.stats(0).oom_retries == 0);
  CHECK(a.stats(0).device_frees == 0);
  a.deallocate(again, 0);
}

TEST_CASE("caching allocator: out of memory while a pool is open keeps the cache") {
  // Returning cached blocks calls cudaFree, which waits for the device: a
  // graph being captured cannot, so the capture gets the device's error.
  FakeDevice dev;
  dev.budget = 10000;
  CachingAllocator a(dev.raw());
  a.deallocate(a.allocate(6000, 0), 0);  // 6144 cached
  const uint64_t pool = a.open_pool(0);
  CHECK_THROWS_WITH_AS(a.allocate(7000, 0), doctest::Contains("fake cuda:0: out of memory"),
                       std::runtime_error);
  CHECK(a.stats(0).oom_retries == 0);
  CHECK(a.stats(0).device_frees == 0);
  a.close_pool(0);
  a.release_pool(pool);
  void* after = a.allocate(7000, 0);  // outside the capture the retry runs
  CHECK(a.stats(0).oom_retries == 1);
  a.deallocate(after, 0);
}

TEST_CASE("caching allocator: live blocks stay with their owner when the cache goes") {
  FakeDevice dev;
  void* kept = nullptr;
  {
    CachingAllocator a(dev.raw());
    kept = a.allocate(1 << 20, 2);
    a.deallocate(a.allocate(512, 2), 2);
  }
  CHECK(dev.frees == 1);  // the cached block only
  CHECK(dev.blocks.count(kept) == 1);
  dev.raw().free(kept, 2);
}

TEST_CASE("caching allocator: a graph's pool keeps its blocks from everyone else") {
  FakeDevice dev;
  {
    CachingAllocator cache(dev.raw());
    void* before = cache.allocate(1000, 0);
    cache.deallocate(before, 0);  // a shared free block: the capture may take it
    const uint64_t pool = cache.open_pool(0);
    CHECK_THROWS_AS(cache.open_pool(0), std::logic_error);
    void* a = cache.allocate(1000, 0);
    CHECK(a == before);
    void* b = cache.allocate(1000, 0);  // a new block
    CHECK(dev.mallocs == 2);
    cache.deallocate(a, 0);  // freed inside the capture: the pool's again...
    void* c = cache.allocate(1000, 0);
    CHECK(c == a);                                 // ...for its later allocations
    void* other_device = cache.allocate(1000, 1);  // no pool open there
    cache.close_pool(0);
    // After the capture: what the graph's blocks go back to stays the graph's.
    cache.deallocate(c, 0);
    cache.deallocate(b, 0);  // the host let go of both; the replays still write them
    void* d = cache.allocate(1000, 0);
    CHECK(d != b);
    CHECK(d != c);
    CHECK(dev.mallocs == 4);  // other_device's and d's
    // The graph is gone: its free blocks are everyone's.
    cache.release_pool(pool);
    void* e = cache.allocate(1000, 0);
    void* f = cache.allocate(1000, 0);
    CHECK(((e == b && f == c) || (e == c && f == b)));
    CHECK(dev.mallocs == 4);
    for (void* p : {d, e, f}) cache.deallocate(p, 0);
    cache.deallocate(other_device, 1);
    CHECK(cache.stats(0).allocated_bytes == 0);
    // A block still held when its pool is released joins the shared cache
    // when it is freed.
    const uint64_t second = cache.open_pool(0);
    void* held = cache.allocate(5000, 0);
    cache.close_pool(0);
    cache.release_pool(second);
    cache.deallocate(held, 0);
    void* again = cache.allocate(5000, 0);
    CHECK(again == held);
    cache.deallocate(again, 0);
  }
  CHECK(dev.blocks.empty());  // the cache returned every block
}

TEST_CASE("caching allocator: a block from before a capture, freed during it, is the graph's") {
  // The graph's kernels read or write it at every replay: work outside the
  // graph must not be given it while the graph lives.
  FakeDevice dev;
  {
    CachingAllocator cache(dev.raw());
    void* before = cache.allocate(1000, 0);  // held when the capture starts
    void* also_before = cache.allocate(1000, 0);
    const uint64_t pool = cache.open_pool(0);
    cache.deallocate(before, 0);
    cache.deallocate(also_before, 0);
    void* inside = cache.allocate(1000, 0);
    CHECK((inside == before || inside == also_before));  // the capture may take them again
    cache.close_pool(0);
    void* outside = cache.allocate(1000, 0);
    CHECK(outside != before);
    CHECK(outside != also_before);
    CHECK(dev.mallocs == 3);
    cache.release_pool(pool);
    void* later = cache.allocate(1000, 0);
    CHECK(later == (inside == before ? also_before : before));  // the graph is gone
    for (void* p : {inside, outside, later}) cache.deallocate(p, 0);
  }
  CHECK(dev.blocks.empty());
}

TEST_CASE("caching allocator: CUDA tensors go through it (on a GPU)") {
  CHECK(cuda_memory_stats(0).allocations >= 0);
  cuda_empty_cache();  // harmless without CUDA
  if (!quanta::testing::have_gpu()) {
    MESSAGE("skipped: " << quanta::testing::no_gpu_reason());
    return;
  }
  cuda_empty_cache();
  const MemoryStats before = cuda_memory_stats(0);
  for (int i = 0; i < 5; ++i) {
    Tensor t = ones({1000, 100}).to(Device::cuda(0));
    CHECK(sum(t).to(Device::cpu()).item<float>() == 100000.0f);
  }
  const MemoryStats after = cuda_memory_stats(0);
  CHECK(after.allocations - before.allocations >= 5);
  CHECK(after.cache_hits - before.cache_hits >= 4);  // the same block, each time
  CHECK(after.allocated_bytes == before.allocated_bytes);
}

// A failed cudaMalloc leaves its error as the thread's last CUDA error; had
// it stayed, the next kernel's launch check would report an out-of-memory
// that did not happen (after the allocator's retry succeeded, say).
TEST_CASE("caching allocator: a failed device allocation leaves no error behind (on a GPU)") {
  if (!quanta::testing::have_gpu()) {
    MESSAGE("skipped: " << quanta::testing::no_gpu_reason());
    return;
  }
  const Device gpu = Device::cuda(0);
  const Tensor small = ones({1000}).to(gpu);
  std::string what;
  try {
    (void)empty({int64_t(1) << 50}, {.dtype = DType::u8, .device = gpu});  // 1 PiB
  } catch (const std::exception& e) {
    what = e.what();
  }
  CHECK(what.find("out of memory") != std::string::npos);
  // Kernels launched now must not see the failed allocation's error.
  CHECK(sum(small * 2.0).to(Device::cpu()).item<float>() == 2000.0f);
}
