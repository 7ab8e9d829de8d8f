// Host<->device copies: the pinned staging plan (engine/cuda/staging.h) and
// the asynchronous uploads' ring (engine/cuda/upload_ring.h) on the CPU, and
// on a GPU the copies themselves, staged, plain and queued, ordered with the
// kernels around them.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "engine/cuda/runtime.h"
#include "engine/cuda/staging.h"
#include "engine/cuda/upload_ring.h"
#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;
using cuda::StagedChunk;
using cuda::UploadSpan;

TEST_CASE("staging: only pageable host memory at or above the threshold is staged") {
  CHECK_FALSE(cuda::use_staging(0, false));
  CHECK_FALSE(cuda::use_staging(cuda::kStagingThresholdBytes - 1, false));
  CHECK(cuda::use_staging(cuda::kStagingThresholdBytes, false));
  CHECK(cuda::use_staging(std::size_t(1) << 32, false));
  CHECK_FALSE(cuda::use_staging(std::size_t(1) << 32, true));  // pinned: straight to the DMA
  CHECK(cuda::use_staging(10, false, 10));
  CHECK_FALSE(cuda::use_staging(0, false, 0));  // nothing to copy
  // The threshold gives the double-buffered pipeline something to overlap.
  static_assert(cuda::kStagingThresholdBytes >= 2 * cuda::kStagingChunkBytes);
  static_assert(cuda::kStagingBuffers == 2);
}

TEST_CASE("staging: the plan covers the copy in order, alternating buffers") {
  CHECK(cuda::staging_plan(0).empty());
  CHECK(cuda::staging_plan(1, 4) == std::vector<StagedChunk>{{0, 1, 0}});
  CHECK(cuda::staging_plan(4, 4) == std::vector<StagedChunk>{{0, 4, 0}});
  CHECK(cuda::staging_plan(9, 4) == std::vector<StagedChunk>{{0, 4, 0}, {4, 4, 1}, {8, 1, 0}});
  CHECK(cuda::staging_plan(12, 4) == std::vector<StagedChunk>{{0, 4, 0}, {4, 4, 1}, {8, 4, 0}});
  CHECK(cuda::staging_plan(3, 0) ==
        std::vector<StagedChunk>{{0, 1, 0}, {1, 1, 1}, {2, 1, 0}});  // no chunk size: bytes
  for (std::size_t n : {cuda::kStagingThresholdBytes, cuda::kStagingThresholdBytes + 3,
                        std::size_t(5) * cuda::kStagingChunkBytes - 1}) {
    CAPTURE(n);
    const std::vector<StagedChunk> plan = cuda::staging_plan(n);
    REQUIRE(!plan.empty());
    std::size_t next = 0;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      CHECK(plan[i].offset == next);
      CHECK(plan[i].bytes > 0);
      CHECK(plan[i].bytes <= cuda::kStagingChunkBytes);
      CHECK(plan[i].buffer == int(i % 2));
      if (i + 1 < plan.size()) CHECK(plan[i].bytes == cuda::kStagingChunkBytes);
      next += plan[i].bytes;
    }
    CHECK(next == n);
  }
}

TEST_CASE("upload ring: uploads follow each other, aligned, and wait only for bytes still queued") {
  cuda::UploadRing ring(1024, 256);
  // {offset, bytes, seq, wait_for}
  CHECK(ring.reserve(1) == UploadSpan{0, 256, 1, 0});      // rounded up to the alignment
  CHECK(ring.reserve(300) == UploadSpan{256, 512, 2, 0});  // two blocks
  CHECK(ring.reserve(256) == UploadSpan{768, 256, 3, 0});  // the ring is full
  // Round again: the first upload's bytes are reused, so it must be over.
  CHECK(ring.reserve(200) == UploadSpan{0, 256, 4, 1});
  // Overlapping the second upload (bytes 256-767) and not the third.
  CHECK(ring.reserve(512) == UploadSpan{256, 512, 5, 2});
  // Does not fit before the end (768 + 512 > 1024): from the start, where
  // upload 4 (0-255) and 5 (256-767) are queued; waiting for 5 covers 4, and
  // the skipped tail's upload 3 is older still.
  CHECK(ring.reserve(512) == UploadSpan{0, 512, 6, 5});
  // Nothing older than 6 is queued now: only 6 overlaps.
  CHECK(ring.reserve(1024) == UploadSpan{0, 1024, 7, 6});
  CHECK(ring.reserve(1) == UploadSpan{0, 256, 8, 7});
  CHECK_THROWS_WITH_AS(ring.reserve(1025),
                       doctest::Contains("1025 bytes does not fit a ring of 1024"),
                       std::invalid_argument);
  CHECK_THROWS_AS(ring.reserve(0), std::invalid_argument);
  // The defaults: every asynchronous upload fits, several at once.
  static_assert(cuda::kUploadRingBytes >= 4 * cuda::kAsyncUploadMaxBytes);
  static_assert(cuda::kAsyncUploadMaxBytes < cuda::kStagingThresholdBytes);
}

TEST_CASE("upload ring: a long run never hands out bytes that a queued upload holds") {
  cuda::UploadRing ring(4096, 64);
  std::vector<UploadSpan> queued;  // what the ring has not yet waited for
  for (std::size_t i = 1; i <= 2000; ++i) {
    const std::size_t n = 1 + (i * 7919) % 1500;
    const UploadSpan s = ring.reserve(n);
    CHECK(s.seq == i);
    CHECK(s.bytes >= n);
    CHECK(s.offset % 64 == 0);
    CHECK(s.offset + s.bytes <= 4096);
    // Everything up to wait_for is done; nothing still queued may overlap.
    std::erase_if(queued, [&](const UploadSpan& q) { return q.seq <= s.wait_for; });
    for (const UploadSpan& q : queued)
      CHECK_FALSE((q.offset < s.offset + s.bytes && s.offset < q.offset + q.bytes));
    queued.push_back(s);
  }
}

TEST_CASE("cuda copies: staged and plain round trips, ordered with kernels") {
  if (!testing::have_gpu()) {
    MESSAGE("skipped: " << testing::no_gpu_reason());
    CHECK_THROWS_WITH_AS(cuda::synchronize(0), doctest::Contains("[cuda"), std::runtime_error);
    return;
  }
  const int64_t chunk_floats = int64_t(cuda::kStagingChunkBytes / 4);
  const int64_t threshold_floats = int64_t(cuda::kStagingThresholdBytes / 4);
  // Below the threshold (plain), exactly at it (whole chunks), and above it
  // with a tail of 3 floats (a short last chunk).
  for (int64_t n : {int64_t(1000), chunk_floats + 1, threshold_floats, threshold_floats + 3,
                    5 * chunk_floats + 3}) {
    CAPTURE(n);
    Tensor x = arange(0.0, double(n), 1.0, {.dtype = DType::f32});
    Tensor g = x.to(Device::cuda(0));
    // A kernel on the device, then the copy back: the staged copy must wait
    // for it (both on the device's stream), and see all of it.
    Tensor y = (g * 2.0).to(Device::cpu());
    const std::vector<float> v = y.to_vector<float>();
    REQUIRE(int64_t(v.size()) == n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += v[size_t(i)] != float(2 * i);
    CHECK(bad == 0);
    // A device tensor overwritten by a host copy right after a kernel read it
    // (below kAsyncUploadMaxBytes the copy is queued and returns at once).
    Tensor h = full({n}, 7.0);
    Tensor sum_before = sum(g);
    copy_(g, h);
    CHECK(sum_before.item() == doctest::Approx(double(n) * double(n - 1) / 2).epsilon(1e-5));
    CHECK(sum(g).item() == doctest::Approx(7.0 * double(n)).epsilon(1e-6));
  }
  cuda::synchronize(0);
}

TEST_CASE("cuda copies: queued uploads reuse their host memory at once and land in order") {
  if (!testing::have_gpu()) {
    MESSAGE("skipped: " << testing::no_gpu_reason());
    return;
  }
  // Many small uploads from ONE host buffer, rewritten after each copy, each
  // into its own slot of a device tensor between kernels that read it: every
  // slot must hold what the host buffer held when its copy was made, and
  // the ring comes round (48 MiB through 32 MiB). Slot sums stay below 2^24,
  // exact in f32.
  const int64_t per = 4096, uploads = 3000;
  Tensor dev = zeros({uploads, per}, {.device = Device::cuda(0)});
  Tensor host = empty({per});
  Tensor total = zeros({}, {.device = Device::cuda(0)});
  for (int64_t i = 0; i < uploads; ++i) {
    fill_(host, double(i));
    copy_(select(dev, 0, i), host);
    total = total + sum(select(dev, 0, i));
  }
  const std::vector<float> v = sum(dev, {1}).to_vector<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < uploads; ++i) bad += v[size_t(i)] != float(i * per);
  CHECK(bad == 0);
  CHECK(total.item() ==
        doctest::Approx(double(per) * double(uploads * (uploads - 1) / 2)).epsilon(1e-5));
}
