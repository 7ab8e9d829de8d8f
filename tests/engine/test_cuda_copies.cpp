// Host<->device copies: the pinned staging plan (engine/cuda/staging.h) on
// the CPU, and on a GPU the copies themselves, staged and plain, ordered
// with the kernels around them.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "engine/cuda/runtime.h"
#include "engine/cuda/staging.h"
#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;
using cuda::StagedChunk;

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
    // A device tensor overwritten by a host copy right after a kernel read it.
    Tensor h = full({n}, 7.0);
    Tensor sum_before = sum(g);
    copy_(g, h);
    CHECK(sum_before.item() == doctest::Approx(double(n) * double(n - 1) / 2).epsilon(1e-5));
    CHECK(sum(g).item() == doctest::Approx(7.0 * double(n)).epsilon(1e-6));
  }
  cuda::synchronize(0);
}
