// code_statistics: the counts and sums under the codebook EMA and k-means.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "engine/cpu/parallel.h"
#include "quant/vq/code_statistics.h"
#include "quanta.h"
#include "support/errors.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::quant;

namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.numel() == 0 ||
          std::memcmp(a.contiguous().raw_data(), b.contiguous().raw_data(), a.nbytes()) == 0);
}

}  // namespace

TEST_CASE("code_statistics: the bits index_add gives, every thread count") {
  const int threads_before = num_threads();
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t n : {0, 1, 7, 5000})
      for (int64_t d : {1, 3, 64}) {
        CAPTURE(n);
        CAPTURE(d);
        const int64_t k = 37;
        Generator gen(static_cast<uint64_t>(n * 100 + d));
        const Tensor x = randn({n, d}, gen, {.dtype = dt});
        const Tensor idx = randint(0, k, {n}, gen);
        const TensorOptions opt{.dtype = dt};
        const Tensor want_counts = index_add(zeros({k}, opt), 0, idx, ones({n}, opt));
        const Tensor want_sums = index_add(zeros({k, d}, opt), 0, idx, x);
        for (int threads : {1, 2, 3}) {
          set_num_threads(threads);
          const CodeStatistics s = code_statistics(idx, x, k);
          CHECK(same_bytes(s.counts, want_counts));
          CHECK(same_bytes(s.sums, want_sums));
        }
        // i32 indices and a strided x give the same.
        const CodeStatistics t = code_statistics(idx.to(DType::i32), x.t().contiguous().t(), k);
        CHECK(same_bytes(t.sums, want_sums));
      }
  set_num_threads(threads_before);
}

TEST_CASE("code_statistics: other floating dtypes, zero codes and bad input") {
  Generator gen(3);
  const Tensor x = randn({6, 2}, gen, {.dtype = DType::bf16});
  const Tensor idx = from_vector<int64_t>({0, 1, 1, 2, 0, 1}, {6});
  const CodeStatistics s = code_statistics(idx, x, 3);
  CHECK(s.counts.dtype() == DType::bf16);
  CHECK(s.counts.to(DType::f32).to_vector<float>() == std::vector<float>{2, 3, 1});
  CHECK(code_statistics(zeros({0}, {.dtype = DType::i64}), zeros({0, 2}), 0).sums.shape() ==
        Shape{0, 2});
  const Tensor xf = randn({6, 2}, gen);
  CHECK_THROWS_WITH_AS(
      code_statistics(idx, xf, 2),
      doctest::Contains("[code_statistics] index 2 is out of bounds for dim 0 with size 2"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(code_statistics(idx, randn({5, 2}, gen), 3),
                       doctest::Contains("needs idx [N] and x [N, D]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(code_statistics(idx.to(DType::f32), xf, 3),
                       doctest::Contains("idx must be i64 or i32"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(code_statistics(idx, xf.to(DType::i64), 3),
                       doctest::Contains("x must be floating"), std::invalid_argument);
}

TEST_CASE("code_statistics: a bad code on a device is found there, named at the next read") {
  for (const Device device : testing::test_devices()) {
    CAPTURE(device.str());
    const Tensor idx = from_vector<int64_t>({0, 5, 1}, {3}).to(device);
    const Tensor x = ones({3, 2}, {.device = device});
    CodeStatistics s;
    {
      HostSyncGuard guard("counting codes");  // the check reads nothing back
      s = code_statistics(idx, x, 2);
    }
    const std::string m = testing::message_of([&] { (void)s.counts.to_vector<float>(); });
    CHECK(m.find("[code_statistics] index 5 is out of bounds for dim 0 with size 2") == 0);
    // The bad row was counted as code 0, never written out of bounds.
    CHECK(s.counts.to_vector<float>() == std::vector<float>{2, 1});
  }
}
