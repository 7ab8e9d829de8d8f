// The device seam: the host-side index and launch arithmetic the CUDA kernels
// rely on (checked here on the CPU), the table lookup and its errors, and,
// where a GPU is visible, the CUDA table's families against the CPU's.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/convert.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/parallel.h"
#include "engine/cuda/blas_layout.h"
#include "engine/cuda/launch.h"
#include "engine/cuda/module.h"
#include "engine/kernels/copy_transposed.h"
#include "engine/kernels/group_norm.h"
#include "engine/kernels/reduce_functors.h"
#include "engine/kernels/strided_index.h"
#include "engine/kernels/table.h"
#include "quanta.h"
#include "support/bf16_products.h"
#include "support/gpu.h"

using namespace quanta;

namespace {

// Offsets by the definition: sum of index * stride over the unmerged dims.
std::vector<int64_t> naive_offsets(const Shape& shape, const Shape& strides) {
  std::vector<int64_t> out;
  const int64_t n = numel_of(shape);
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, off = 0;
    for (size_t d = shape.size(); d-- > 0;) {
      off += (rem % shape[d]) * strides[d];
      rem /= shape[d];
    }
    out.push_back(off);
  }
  return out;
}

// a [m, k] times b [k, n], both row-major, by the definition in f64.
std::vector<double> naive_product(const std::vector<double>& a, const std::vector<double>& b,
                                  int64_t m, int64_t n, int64_t k) {
  std::vector<double> c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j)
        c[size_t(i * n + j)] += a[size_t(i * k + p)] * b[size_t(p * n + j)];
  return c;
}

// The row-major rows x cols values v stored as T, row-major or column-major
// with 3 spare elements (-7) per leading dimension; returns the strides
// (row, column).
template <class T>
std::pair<int64_t, int64_t> stored(const std::vector<double>& v, int64_t rows, int64_t cols,
                                   bool col_major, std::vector<T>& out) {
  const int64_t ld = (col_major ? rows : cols) + 3;
  out.assign(size_t(ld * (col_major ? cols : rows)), cpu::cast<T>(-7.0));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out[size_t(col_major ? j * ld + i : i * ld + j)] = cpu::cast<T>(v[size_t(i * cols + j)]);
  return col_major ? std::pair<int64_t, int64_t>{1, ld} : std::pair<int64_t, int64_t>{ld, 1};
}

// One way of calling a GEMM: each operand row- or column-major, C
// overwritten or accumulated into, from this thread or from inside a
// parallel region (two calls, one per task).
struct GemmCall {
  bool a_col = false, b_col = false, accumulate = false, nested = false;
  int calls() const { return nested ? 2 : 1; }
};

std::string describe(const GemmCall& c) {
  std::string s = c.a_col ? " A col-major" : " A row-major";
  s += c.b_col ? ", B col-major" : ", B row-major";
  if (c.accumulate) s += ", accumulate";
  if (c.nested) s += ", inside a parallel region";
  return s;
}

// f(call) for every GemmCall.
template <class F>
void for_each_gemm_call(F&& f) {
  for (const bool a_col : {false, true})
    for (const bool b_col : {false, true})
      for (const bool accumulate : {false, true})
        for (const bool nested : {false, true}) f(GemmCall{a_col, b_col, accumulate, nested});
}

// run(i) for each of c's calls: on this thread, or each from a task of a
// parallel region.
void run_calls(const GemmCall& c, const std::function<void(int)>& run) {
  if (!c.nested) return run(0);
  cpu::parallel_for(0, c.calls(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t call = lo; call < hi; ++call) run(int(call));
  });
}

void check_index(const Shape& shape, const Shape& s0, const Shape& s1) {
  INFO("shape ", shape_str(shape), " strides ", shape_str(s0), " / ", shape_str(s1));
  const auto ix = make_strided_index<2>(shape, {s0.data(), s1.data()}, "test");
  const auto w0 = naive_offsets(shape, s0), w1 = naive_offsets(shape, s1);
  for (int64_t i = 0; i < numel_of(shape); ++i) {
    int64_t off[2];
    ix.offsets(i, off);
    REQUIRE(off[0] == w0[i]);
    REQUIRE(off[1] == w1[i]);
    // The fixed-dims forms the CUDA walk takes for one or two dims.
    int64_t low[2] = {-1, -1};
    if (ix.ndim <= 1) ix.offsets_of_dims<1>(i, low);
    if (ix.ndim == 2) ix.offsets_of_dims<2>(i, low);
    if (ix.ndim <= 2) {
      REQUIRE(low[0] == w0[i]);
      REQUIRE(low[1] == w1[i]);
    }
  }
}

using testing::have_gpu;
std::string skip_reason() { return testing::no_gpu_reason(); }

// Bitwise equality of two tensors' bytes (after moving to the CPU).
bool same_bytes(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  // An empty tensor may have no data pointer: memcmp must not see it.
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         (x.nbytes() == 0 || std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0);
}

double max_rel(const Tensor& got, const Tensor& want) {
  auto g = got.to(Device::cpu()).to_vector<double>(), w = want.to_vector<double>();
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i)
    worst = std::max(worst, std::abs(g[i] - w[i]) / std::max(1.0, std::abs(w[i])));
  return worst;
}

}  // namespace

TEST_CASE("strided index: merged dims give the offsets of the definition") {
  check_index({2, 3, 4}, {12, 4, 1}, {12, 4, 1});           // contiguous: one dim
  check_index({2, 3, 4}, {12, 4, 1}, {0, 1, 0});            // broadcast input
  check_index({4, 3}, {3, 1}, {1, 4});                      // transpose
  check_index({2, 1, 5, 3}, {15, 99, 3, 1}, {0, 7, 0, 2});  // size-1 dim, any stride
  check_index({3, 2, 2}, {8, 4, 2}, {4, 2, 1});             // stepped
  check_index({1}, {5}, {0});
  check_index({}, {}, {});
  check_index({7}, {1}, {0});                     // a scalar broadcast: one dim
  check_index({6}, {3}, {1});                     // a strided view: one dim
  check_index({5, 6}, {6, 1}, {1, 0});            // a column broadcast: two dims
  check_index({5, 6}, {6, 1}, {0, 1});            // a row broadcast: two dims
  check_index({3, 4, 5}, {20, 5, 1}, {0, 5, 1});  // merged to two dims
  {
    // 2^32 + 65536 elements: the two-dims form without the 32-bit divider.
    const auto big =
        make_strided_index<2>({65536, 65537}, {Shape{65537, 1}.data(), Shape{1, 0}.data()}, "test");
    REQUIRE(big.ndim == 2);
    CHECK_FALSE(big.narrow);
    for (const int64_t i : {int64_t{0}, int64_t{65536}, int64_t{65537}, int64_t{1} << 32,
                            int64_t{65536} * 65537 - 1}) {
      int64_t want[2], got[2];
      big.offsets(i, want);
      big.offsets_of_dims<2>(i, got);
      CHECK(got[0] == want[0]);
      CHECK(got[1] == want[1]);
      CHECK(got[1] == i / 65537);
    }
  }
  const auto empty = make_strided_index<1>({3, 0, 2}, {Shape{0, 2, 1}.data()}, "test");
  CHECK(empty.ndim == 0);
  const auto dense =
      make_strided_index<2>({2, 3, 4}, {Shape{12, 4, 1}.data(), Shape{12, 4, 1}.data()}, "test");
  CHECK(dense.dense);
  CHECK(dense.ndim == 1);
}

TEST_CASE("strided index: too many unmergeable dims fail naming the op") {
  Shape shape(10, 2), strides;
  for (int d = 0; d < 10; ++d) strides.push_back(int64_t(1) << (2 * (9 - d)));  // gaps
  CHECK_THROWS_WITH_AS(make_strided_index<1>(shape, {strides.data()}, "exp"),
                       doctest::Contains("[exp]"), std::invalid_argument);
}

TEST_CASE("IntDivider: multiply-and-shift division equals n / d below 2^31") {
  const uint32_t top = (uint32_t(1) << 31) - 1;  // the largest dividend it takes
  for (const uint32_t d : {1u,
                           2u,
                           3u,
                           5u,
                           7u,
                           10u,
                           16u,
                           100u,
                           768u,
                           1000u,
                           3072u,
                           4095u,
                           4096u,
                           16384u,
                           65537u,
                           (1u << 20) + 3u,
                           (1u << 30) + 1u,
                           top - 1,
                           top,
                           1u << 31}) {
    INFO("divisor ", d);
    const IntDivider div(d);
    bool same = true;
    for (uint32_t n = 0; n < 20000; ++n) same = same && div.div(n) == n / d;
    // Around every multiple of d near the top, and the top itself.
    for (uint64_t k = top / d; k + 3 > top / d && k > 0; --k)
      for (int64_t e = -2; e <= 2; ++e) {
        const int64_t n = static_cast<int64_t>(k * d) + e;
        if (n >= 0 && n <= top) same = same && div.div(uint32_t(n)) == uint32_t(n) / d;
      }
    uint64_t x = 88172645463325252ull;  // xorshift: spread dividends
    for (int i = 0; i < 20000; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      const auto n = static_cast<uint32_t>(x % (uint64_t(top) + 1));
      same = same && div.div(n) == n / d;
    }
    CHECK(same);
  }
  CHECK_THROWS_AS(IntDivider(0), std::invalid_argument);
}

TEST_CASE("strided index past 2^31 elements divides in 64 bits") {
  // Only the index is built (no memory): a [2^16, 2^16] walk with a broadcast row.
  const int64_t side = int64_t(1) << 16;
  const Shape shape{side, side}, full{side, 1}, row{0, 1};
  const auto ix = make_strided_index<2>(shape, {full.data(), row.data()}, "test");
  CHECK_FALSE(ix.narrow);
  for (const int64_t i : {int64_t(0), 3 * side + 5, (int64_t(1) << 31) + 7, side * side - 1}) {
    int64_t off[2];
    ix.offsets(i, off);
    CHECK(off[0] == i);
    CHECK(off[1] == i % side);
  }
  CHECK(make_strided_index<2>({4, 5}, {Shape{5, 1}.data(), Shape{0, 1}.data()}, "test").narrow);
}

TEST_CASE("fold_share: a thread's share of a row, in order, each value once, loads ahead") {
  std::vector<double> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i) * 0.5;
  for (const int64_t step : {1, 7, 32, 256})
    for (const int64_t n : {0, 1, 5, 8, 9, 255, 256, 257, 1000}) {
      std::vector<int64_t> seen;
      bool ordered = true;
      for (int64_t first = 0; first < step; ++first) {
        int64_t want = first;
        const int64_t folded = fn::fold_share(
            int64_t{0}, v.data(), first, step, n, [&](int64_t count, double x, int64_t i) {
              ordered = ordered && i == want && x == v[static_cast<size_t>(i)];
              seen.push_back(i);
              want += step;
              return count + 1;
            });
        ordered = ordered && want >= n && folded == (want - first) / step;
      }
      CAPTURE(step);
      CAPTURE(n);
      CHECK(ordered);
      std::sort(seen.begin(), seen.end());
      std::vector<int64_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      CHECK(seen == all);
    }
}

TEST_CASE("fold_pairs: a thread's share of an [a, b] walk without divisions, loads ahead") {
  // Every (first, step) a block of threads uses, against t / b and t % b:
  // each pair read once and folded in the walk's order.
  for (const int64_t step : {1, 7, 32, 256}) {
    for (const int64_t a : {0, 1, 3, 40}) {
      for (const int64_t b : {1, 2, 31, 32, 33, 255, 256, 257, 1000}) {
        std::vector<int64_t> seen;
        bool ordered = true;
        constexpr int64_t kApart = 1 << 20;  // above every b: (i, j) read back from one value
        for (int64_t first = 0; first < step; ++first) {
          int64_t t = first, reads = 0;
          const int64_t folded = fn::fold_pairs(
              int64_t{0}, first, step, a, b,
              [&](int64_t i, int64_t j) {
                ++reads;
                return i * kApart + j;
              },
              [&](int64_t count, int64_t ij) {
                ordered = ordered && ij / kApart == t / b && ij % kApart == t % b;
                seen.push_back(ij / kApart * b + ij % kApart);
                t += step;
                return count + 1;
              });
          ordered = ordered && t >= a * b && folded == reads;  // stopped only past the end
        }
        CAPTURE(step);
        CAPTURE(a);
        CAPTURE(b);
        CHECK(ordered);
        std::sort(seen.begin(), seen.end());
        std::vector<int64_t> all(static_cast<size_t>(a * b));
        std::iota(all.begin(), all.end(), 0);
        CHECK(seen == all);
      }
    }
  }
}

TEST_CASE("fold_strided: a column's fold with loads ahead, in a plain loop's order and bits") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const int64_t n : {0, 1, 7, 8, 9, 16, 17, 1000}) {
    for (const int64_t stride : {1, 3}) {
      CAPTURE(n);
      CAPTURE(stride);
      std::vector<float> v(static_cast<size_t>(std::max<int64_t>(n * stride, 1)));
      for (float& x : v) x = u(rng) * 1e3f;  // sums whose rounding shows the order
      if (n > 5) v[static_cast<size_t>(5 * stride)] = std::numeric_limits<float>::quiet_NaN();
      float sum = 0.0f;
      double wide = 0.0;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        const float x = v[static_cast<size_t>(i * stride)];
        sum = fn::FoldSum{}(sum, x);
        wide = fn::FoldSum{}(wide, static_cast<double>(x));
        top = fn::FoldExtreme<true>{}(top, x);
      }
      const float got_sum = fn::fold_strided(0.0f, v.data(), n, stride, fn::FoldSum{});
      const double got_wide = fn::fold_strided(0.0, v.data(), n, stride, fn::FoldSum{});
      const float got_top = fn::fold_strided(-std::numeric_limits<float>::infinity(), v.data(), n,
                                             stride, fn::FoldExtreme<true>{});
      CHECK(std::memcmp(&got_sum, &sum, sizeof sum) == 0);  // NaN included
      CHECK(std::memcmp(&got_wide, &wide, sizeof wide) == 0);
      CHECK(std::memcmp(&got_top, &top, sizeof top) == 0);
    }
  }
}

TEST_CASE("launch config: empty launches skipped, blocks capped") {
  using cuda::kThreadsPerBlock;
  CHECK(cuda::launch_config(0, 100).blocks == 0);
  CHECK(cuda::launch_config(-3, 100).blocks == 0);
  CHECK(cuda::launch_config(1, 100).blocks == 1);
  CHECK(cuda::launch_config(kThreadsPerBlock, 100).blocks == 1);
  CHECK(cuda::launch_config(kThreadsPerBlock + 1, 100).blocks == 2);
  CHECK(cuda::launch_config(int64_t(1) << 40, 1056).blocks == 1056);
}

TEST_CASE("grid reduction pieces: cut only a long reduction with few outputs") {
  using cuda::grid_pieces;
  auto g = grid_pieces(1 << 20, 4096);  // many outputs: one piece each
  CHECK((g.pieces == 1 && g.piece == 4096));
  g = grid_pieces(10, 40);  // too short to cut
  CHECK((g.pieces == 1 && g.piece == 40));
  g = grid_pieces(768, 8192);  // a bias gradient over 8192 rows
  CHECK(g.pieces > 1);
  CHECK(g.piece >= cuda::kMinPiece);
  CHECK(g.piece * g.pieces >= 8192);
  CHECK(g.piece * (g.pieces - 1) < 8192);  // no empty piece
  CHECK(768 * g.pieces <= 2 * cuda::kBusyThreads);
  g = grid_pieces(1, 1000003);  // a prime length: the last piece is shorter
  CHECK(g.piece * (g.pieces - 1) < 1000003);
  CHECK(g.piece * g.pieces >= 1000003);
  CHECK(grid_pieces(0, 100).pieces == 1);
}

TEST_CASE("row norms on CUDA: lanes per row by row length") {
  CHECK(cuda::row_lanes(1) == 1);
  CHECK(cuda::row_lanes(4) == 1);  // FSQ-sized rows: a thread each
  CHECK(cuda::row_lanes(8) == 8);
  CHECK(cuda::row_lanes(16) == 8);  // a 16-dim codebook: four rows per warp
  CHECK(cuda::row_lanes(32) == 32);
  CHECK(cuda::row_lanes(512) == 32);
  for (int64_t d : {1, 7, 8, 31, 32, 1000}) CHECK(32 % cuda::row_lanes(d) == 0);
}

TEST_CASE("blas layout: row-major, column-major, size-1 dims, refusals") {
  auto l = cuda::blas_layout(3, 4, 4, 1);
  CHECK((l.ok && l.row_major && l.ld == 4));
  l = cuda::blas_layout(3, 4, 1, 3);
  CHECK((l.ok && !l.row_major && l.ld == 3));
  l = cuda::blas_layout(3, 4, 8, 1);  // padded rows
  CHECK((l.ok && l.row_major && l.ld == 8));
  l = cuda::blas_layout(1, 4, 0, 1);  // one row: any row stride
  CHECK((l.ok && l.ld >= 4));
  l = cuda::blas_layout(3, 1, 1, 0);  // one column: any column stride
  CHECK((l.ok && l.ld >= 1));
  CHECK_FALSE(cuda::blas_layout(3, 4, 8, 2).ok);  // no unit stride
  CHECK_FALSE(cuda::blas_layout(3, 4, 2, 1).ok);  // rows overlap
}

TEST_CASE("kernel table: lookup by device, op names, mixed devices refused") {
  CHECK(std::string(kernels(Device::cpu()).device_name) == "cpu");
  CHECK(std::string(op_name(UnaryOp::exp)) == "exp");
  CHECK(std::string(op_name(BinaryOp::logical_xor)) == "logical_xor");
  CHECK(std::string(op_name(UpdateOp::addcdiv)) == "addcdiv");
  CHECK(is_predicate(BinaryOp::eq));
  CHECK_FALSE(is_predicate(BinaryOp::minimum));
  if (!cuda::module()) {
    // Without a CUDA backend the CUDA slot still exists and names the op it
    // cannot run, and why.
    const KernelTable& k = kernels(Device::cuda(0));
    const Shape shape{2};
    const int64_t st[1] = {1};
    float buf[2] = {0, 0};
    const std::string why = "[fill_] " + cuda::unavailable_reason();
    CHECK_THROWS_WITH(k.fill(shape, {buf, DType::f32, st}, 1.0), why.c_str());
    CHECK_THROWS_WITH(
        k.unary(UnaryOp::tanh, {}, shape, {buf, DType::f32, st}, {buf, DType::f32, st}),
        doctest::Contains("[tanh]"));
  }
  if (!have_gpu()) {
    MESSAGE("cuda table checks skipped: " << skip_reason());
    return;
  }
  Tensor a = ones({2}), b = ones({2}).to(Device::cuda(0));
  CHECK_THROWS_WITH_AS(add(a, b), doctest::Contains("different devices"), std::invalid_argument);
}

// The transposes the CUDA convolutions run around channels-last layers that
// their im2col path and cuDNN's filters see the other way round: checked on
// the CPU's copy, and on the CUDA table's where a GPU is visible.
TEST_CASE("copy_transposed: dst [b, q, p] = src [b, p, q] through a table's copy") {
  struct Case {
    int64_t batch, p, q;
  };
  const std::vector<Case> cases = {{2, 49, 32}, {3, 32, 9}, {1, 1, 5}, {4, 7, 1}, {0, 3, 4}};
  std::vector<Device> devices{Device::cpu()};
  if (have_gpu()) devices.push_back(Device::cuda(0));
  for (const Device dev : devices)
    for (const DType dt : {DType::f32, DType::f64})
      for (const Case& c : cases) {
        CAPTURE(dev.str());
        CAPTURE(dtype_name(dt));
        CAPTURE(c.batch);
        CAPTURE(c.p);
        CAPTURE(c.q);
        const Tensor src = arange(0, double(c.batch * c.p * c.q), 1, {.dtype = dt})
                               .reshape({c.batch, c.p, c.q})
                               .to(dev);
        const Tensor dst = empty({c.batch, c.q, c.p}, {.dtype = dt, .device = dev});
        copy_transposed(kernels(dev).copy, dt, c.batch, c.p, c.q, src.raw_data(), dst.raw_data());
        CHECK(
            same_bytes(dst.to(Device::cpu()), transpose(src, 1, 2).contiguous().to(Device::cpu())));
      }
  if (!have_gpu()) MESSAGE("cuda:0 not checked: " << skip_reason());
}

TEST_CASE("cuda: fill, casts and strided copies equal the CPU's bytes") {
  if (!have_gpu()) {
    MESSAGE("skipped: " << skip_reason());
    return;
  }
  const Device gpu = Device::cuda(0);
  const std::vector<DType> types{DType::f32, DType::f64, DType::bf16, DType::f16,
                                 DType::i32, DType::i64, DType::u8,   DType::boolean};
  Generator gen(3);
  Tensor src = randn({5, 7}, gen) * 40.0;
  for (DType from : types) {
    Tensor x = src.to(from);
    Tensor xg = x.to(gpu);
    REQUIRE(same_bytes(xg, x));
    for (DType to : types) {
      const std::string pair = std::string(dtype_name(from)) + " -> " + dtype_name(to);
      INFO(pair);
      CHECK(same_bytes(xg.to(to), x.to(to)));
      // Strided source: a transpose copied to contiguous.
      CHECK(same_bytes(transpose(xg, 0, 1).contiguous().to(to),
                       transpose(x, 0, 1).contiguous().to(to)));
    }
    CHECK(same_bytes(full({3, 4}, 2.5, {.dtype = from, .device = gpu}),
                     full({3, 4}, 2.5, {.dtype = from})));
  }
  // Zero-size tensors move and fill without a launch.
  CHECK(zeros({0, 3}, {.device = gpu}).to(Device::cpu()).numel() == 0);
}

TEST_CASE("cuda: GEMM layouts, batches and bias equal the CPU within f32 rounding") {
  if (!have_gpu()) {
    MESSAGE("skipped: " << skip_reason());
    return;
  }
  const Device gpu = Device::cuda(0);
  Generator gen(11);
  struct Case {
    Shape a, b;
    bool ta, tb;
  };
  for (const Case& c : std::vector<Case>{{{7, 5}, {5, 3}, false, false},
                                         {{5, 7}, {5, 3}, true, false},
                                         {{7, 5}, {3, 5}, false, true},
                                         {{5, 7}, {3, 5}, true, true},
                                         {{4, 7, 5}, {5, 3}, false, false},
                                         {{4, 7, 5}, {4, 5, 3}, false, false},
                                         {{2, 1, 7, 5}, {3, 5, 6}, false, false},
                                         {{130, 257}, {257, 65}, false, false},
                                         {{3, 0}, {0, 4}, false, false}}) {
    INFO("a ", shape_str(c.a), " b ", shape_str(c.b), " ta ", c.ta, " tb ", c.tb);
    for (DType dt : {DType::f64, DType::f32}) {
      Tensor a = randn(c.a, gen).to(dt), b = randn(c.b, gen).to(dt);
      if (c.ta) a = transpose(a, -1, -2);
      if (c.tb) b = transpose(b, -1, -2);
      Tensor want = matmul(a, b);
      Tensor got = matmul(a.to(gpu), b.to(gpu));
      CHECK(got.device() == gpu);
      CHECK(max_rel(got, want) <= (dt == DType::f64 ? 1e-12 : 1e-5));
    }
  }
  Tensor x = randn({6, 9}, gen), w = randn({4, 9}, gen), bias = randn({4}, gen);
  CHECK(max_rel(linear(x.to(gpu), w.to(gpu), bias.to(gpu)), linear(x, w, bias)) <= 1e-5);
  CHECK(max_rel(linear(x.to(gpu), w.to(gpu), Tensor()), linear(x, w, Tensor())) <= 1e-5);
}

TEST_CASE("cuda: row sums, short and long rows, integral into i64") {
  if (!have_gpu()) {
    MESSAGE("skipped: " << skip_reason());
    return;
  }
  const Device gpu = Device::cuda(0);
  Generator gen(5);
  for (const Shape& shape :
       std::vector<Shape>{{3, 4}, {1, 1 << 20}, {2, 300000}, {1000, 17}, {0, 5}, {5, 0}}) {
    INFO("shape ", shape_str(shape));
    Tensor x = randn(shape, gen).to(DType::f64);
    CHECK(max_rel(sum(x.to(gpu), {-1}), sum(x, {-1})) <= 1e-12);
    CHECK(max_rel(sum(x.to(gpu), {0}), sum(x, {0})) <= 1e-12);
    CHECK(max_rel(sum(x.to(gpu)), sum(x)) <= 1e-12);
    Tensor i = (x * 10.0).to(DType::i32);
    CHECK(same_bytes(sum(i.to(gpu), {-1}), sum(i, {-1})));
  }
}

TEST_CASE("cuda: in-place updates (add_, mul_, div_, addcmul_, addcdiv_) equal the CPU's") {
  if (!have_gpu()) {
    MESSAGE("skipped: " << skip_reason());
    return;
  }
  const Device gpu = Device::cuda(0);
  Generator gen(29);
  const Tensor base = randn({33, 7}, gen, {.dtype = DType::f64});
  const Tensor a = randn({33, 7}, gen, {.dtype = DType::f64});
  const Tensor row = randn({7}, gen, {.dtype = DType::f64});
  const Tensor pos = rand({33, 7}, gen, {.dtype = DType::f64}) + 0.5;
  auto both = [&](const char* what, auto&& f) {
    Tensor c = base.clone(), g = base.to(gpu);
    f(c, Device::cpu());
    f(g, gpu);
    INFO(what);
    CHECK(max_rel(g, c) <= 1e-15);
  };
  both("add_ alpha", [&](Tensor& d, Device dev) { add_(d, a.to(dev), -0.3); });
  both("add_ row", [&](Tensor& d, Device dev) { add_(d, row.to(dev), 2.0); });
  both("mul_ scalar", [&](Tensor& d, Device) { mul_(d, 0.9); });
  both("mul_ tensor", [&](Tensor& d, Device dev) { mul_(d, a.to(dev)); });
  both("div_", [&](Tensor& d, Device dev) { div_(d, pos.to(dev)); });
  both("addcmul_", [&](Tensor& d, Device dev) { addcmul_(d, a.to(dev), a.to(dev), 0.001); });
  both("addcdiv_", [&](Tensor& d, Device dev) { addcdiv_(d, a.to(dev), pos.to(dev), -0.01); });
  both("clone then add_ self", [&](Tensor& d, Device) {
    Tensor e = d.clone();
    add_(e, d, 0.5);
    copy_(d, e);
  });
  both("f32 round trip", [&](Tensor& d, Device) { copy_(d, d.to(DType::f32).to(DType::f64)); });
}

TEST_CASE("scale_n: every tensor times a device factor, mul_'s bits, chunks and empties") {
  Generator gen(31);
  for (const Device dev : testing::cpu_and_test_devices()) {
    for (const DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      INFO(dev.str() << " " << dtype_name(dt));
      // More tensors than a CUDA launch takes (64), sizes 0 to 300.
      std::vector<Tensor> xs, expected;
      std::vector<TensorSpan> list;
      const Tensor factor = scalar(0.37, {.dtype = dt, .device = dev});
      for (int i = 0; i < 70; ++i) {
        xs.push_back(randn({(i * 37) % 301}, gen).to(dt).to(dev));
        expected.push_back(xs.back().clone());
        mul_(expected.back(), factor);
        list.push_back({xs.back().raw_data(), xs.back().numel()});
      }
      kernels(dev).scale_n(dt, {list.data(), static_cast<int64_t>(list.size())}, factor.raw_data());
      for (size_t i = 0; i < xs.size(); ++i) CHECK(same_bytes(xs[i], expected[i]));
      kernels(dev).scale_n(dt, {nullptr, 0}, factor.raw_data());  // nothing to scale
    }
  }
}

TEST_CASE("norm_n: every tensor's norm, stat_rows' bits, chunks, empties and NaN") {
  Generator gen(37);
  for (const Device dev : testing::cpu_and_test_devices()) {
    for (const DType dt : {DType::f32, DType::f64}) {
      // More tensors than a CUDA launch takes (64): sizes 0 to 300, one of
      // 70000 (many elements a thread), one holding a NaN.
      std::vector<Tensor> xs;
      std::vector<TensorSpan> list;
      for (int i = 0; i < 70; ++i) {
        const int64_t n = i == 5 ? 70000 : (i * 37) % 301;
        Tensor x = randn({n}, gen);
        if (i == 9) x.data<float>()[0] = NAN;
        xs.push_back(x.to(dt).to(dev));
        list.push_back({xs.back().raw_data(), xs.back().numel()});
      }
      for (const double p : {2.0, 1.0, 3.0, double(INFINITY)}) {
        INFO(dev.str() << " " << dtype_name(dt) << " p " << p);
        const TensorOptions opts{.dtype = dt, .device = dev};
        const Tensor out = full({70}, -1.0, {.dtype = DType::f64, .device = dev});
        const Tensor one = full({1}, -1.0, opts);
        kernels(dev).norm_n(dt, p, {list.data(), static_cast<int64_t>(list.size())},
                            static_cast<double*>(out.raw_data()));
        const std::vector<double> got = out.to(Device::cpu()).to_vector<double>();
        for (size_t i = 0; i < xs.size(); ++i) {
          INFO("tensor " << i << " of " << xs[i].numel());
          kernels(dev).stat_rows(RowStat::norm, p, dt, xs[i].raw_data(), 1, xs[i].numel(),
                                 one.raw_data());
          // stat_rows' bits, widened to f64.
          CHECK(same_bytes(slice(out, 0, i, i + 1), one.to(DType::f64)));
          if (xs[i].numel() == 0) CHECK(got[i] == 0.0);
          if (i == 9) CHECK(std::isnan(got[i]));
        }
        // Nothing to take: nothing written.
        kernels(dev).norm_n(dt, p, {nullptr, 0}, static_cast<double*>(out.raw_data()));
      }
    }
  }
}

TEST_CASE("group_norm's device walk and functors, run on the host, give the CPU kernel's values") {
  // CUDA's kernels walk a group as 256 threads' shares (fn::walk_share) and
  // compute each element with fn::norm_out and fn::norm_grad_x; the CPU's
  // kernels are Eigen's. Here the walk runs on the host as a block would:
  // every element visited once with its channel, and the functors' values
  // equal to the CPU kernel's.
  Generator gen(53);
  const double eps = 1e-5;
  for (const NormGeom& g :
       {NormGeom{.batch = 2, .channels = 6, .spatial = 300, .groups = 3},
        NormGeom{.batch = 2, .channels = 6, .spatial = 300, .groups = 3, .channels_last = true},
        NormGeom{.batch = 5, .channels = 700, .spatial = 1, .groups = 1}}) {
    INFO("channels " << g.channels << " spatial " << g.spatial
                     << std::string(g.channels_last ? " channels last" : ""));
    const int64_t n = g.batch * g.channels * g.spatial, threads = 256;
    const Tensor x = randn({n}, gen, {.dtype = DType::f64}) * 2.0 + 0.5;
    const Tensor gy = randn({n}, gen, {.dtype = DType::f64});
    const Tensor w = randn({g.channels}, gen, {.dtype = DType::f64});
    const Tensor b = randn({g.channels}, gen, {.dtype = DType::f64});
    const double *xs = x.data<double>(), *gys = gy.data<double>(), *ws = w.data<double>(),
                 *bs = b.data<double>();
    // The CPU kernel's results.
    const Tensor y = empty({n}, {.dtype = DType::f64}), gx = empty({n}, {.dtype = DType::f64});
    const Tensor mean = empty({g.group_count()}, {.dtype = DType::f64});
    const Tensor rstd = empty({g.group_count()}, {.dtype = DType::f64});
    kernels(Device::cpu())
        .group_norm(DType::f64, g, eps, xs, ws, bs, y.raw_data(), mean.raw_data(), rstd.raw_data());
    kernels(Device::cpu())
        .group_norm_grad(DType::f64, g, xs, ws, mean.raw_data(), rstd.raw_data(), gys,
                         gx.raw_data(), nullptr, nullptr, false);
    std::vector<int> visits(static_cast<size_t>(n), 0);
    double worst_y = 0, worst_gx = 0;
    for (int64_t q = 0; q < g.group_count(); ++q) {
      const fn::GroupWalk walk = fn::group_walk(g, q);
      // Pass 1: the threads' sums, then the block's; the elements' channels.
      double sum = 0, sum_g = 0, sum_gx = 0;
      for (int64_t t = 0; t < threads; ++t)
        fn::walk_share(walk, t, threads, [&](int64_t off, int64_t c) {
          ++visits[static_cast<size_t>(off)];
          const int64_t item = q / g.groups;
          const int64_t want_c = g.channels_last ? off % g.channels : off / g.spatial % g.channels;
          CHECK(c == want_c);
          CHECK(off / (g.channels * g.spatial) == item);
          CHECK(c / g.group_channels() == q % g.groups);
          sum += xs[off];
        });
      const double mu = fn::norm_mean<double>(sum, g.group_size());
      double sq = 0;
      for (int64_t t = 0; t < threads; ++t)
        fn::walk_share(walk, t, threads,
                       [&](int64_t off, int64_t) { sq += (xs[off] - mu) * (xs[off] - mu); });
      const double r = fn::norm_rstd(fn::norm_mean<double>(sq, g.group_size()), eps);
      CHECK(mu == doctest::Approx(mean.data<double>()[q]).epsilon(1e-12));
      CHECK(r == doctest::Approx(rstd.data<double>()[q]).epsilon(1e-12));
      for (int64_t t = 0; t < threads; ++t)
        fn::walk_share(walk, t, threads, [&](int64_t off, int64_t c) {
          worst_y = std::max(
              worst_y, std::abs(fn::norm_out(xs[off], mu, r, ws, bs, c) - y.data<double>()[off]));
          const double gs = fn::norm_scaled_grad(gys[off], ws, c);
          sum_g += gs;
          sum_gx += gs * ((xs[off] - mu) * r);
        });
      const double mean_g = fn::norm_mean<double>(sum_g, g.group_size());
      const double mean_gx = fn::norm_mean<double>(sum_gx, g.group_size());
      for (int64_t t = 0; t < threads; ++t)
        fn::walk_share(walk, t, threads, [&](int64_t off, int64_t c) {
          const double v = fn::norm_grad_x(fn::norm_scaled_grad(gys[off], ws, c),
                                           (xs[off] - mu) * r, r, mean_g, mean_gx);
          worst_gx = std::max(worst_gx, std::abs(v - gx.data<double>()[off]));
        });
    }
    // Every element once in each of the first pass's walks.
    CHECK(std::all_of(visits.begin(), visits.end(), [](int v) { return v == 1; }));
    CHECK(worst_y < 1e-12);
    CHECK(worst_gx < 1e-12);
  }
}

TEST_CASE("clip_factor: the total norm and the factor in one call, every p and factor dtype") {
  // Against the chain it replaces: the total as pow(sum(pow(norms, p)),
  // 1 / p) or amax, the factor clamp(max_norm / (total + 1e-6), NAN, 1)
  // converted to the gradients' dtype.
  Generator gen(47);
  const Tensor norms = rand({300}, gen, {.dtype = DType::f64}) * 3.0;
  Tensor with_nan = norms.clone();
  with_nan.data<double>()[7] = NAN;
  for (const Device dev : testing::cpu_and_test_devices()) {
    for (const Tensor& ns : {norms, with_nan, zeros({0}, {.dtype = DType::f64})}) {
      for (const double p : {2.0, 1.0, 3.0, double(INFINITY)}) {
        for (const double max_norm : {1.0, 1e6}) {
          const Tensor want_total = std::isinf(p)
                                        ? (ns.numel() ? amax(ns) : zeros({}, {.dtype = DType::f64}))
                                        : pow(sum(pow(ns, p)), 1.0 / p);
          for (const DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
            INFO(dev.str() << " " << std::string(dtype_name(dt)) << " p " << p << " count "
                           << ns.numel() << " max_norm " << max_norm);
            const Tensor n = ns.to(dev);
            const Tensor total = full({}, -1.0, {.dtype = DType::f64, .device = dev});
            const Tensor factor = full({}, -1.0, {.dtype = dt, .device = dev});
            kernels(dev).clip_factor(static_cast<const double*>(n.raw_data()), n.numel(), p,
                                     max_norm, dt, static_cast<double*>(total.raw_data()),
                                     factor.raw_data());
            const double t = total.item(), w = want_total.item();
            if (std::isnan(w)) {
              CHECK(std::isnan(t));
              CHECK(std::isnan(factor.to(DType::f64).item()));
              continue;
            }
            // Summed in order here, by Eigen's vector code in the chain;
            // the factor is the chain's of this total, bit for bit.
            CHECK(t == doctest::Approx(w).epsilon(1e-14));
            const Tensor want = clamp(max_norm / (total.to(Device::cpu()) + 1e-6), NAN, 1.0);
            CHECK(same_bytes(factor.to(Device::cpu()), want.to(dt)));
            if (max_norm == 1e6) CHECK(factor.to(DType::f64).item() == 1.0);
          }
        }
      }
    }
  }
}

TEST_CASE("copy_blocks: blocks of rows into strided rows, every width, chunks and empties") {
  Generator gen(41);
  for (const Device dev : testing::cpu_and_test_devices()) {
    for (const DType dt : {DType::f32, DType::f64, DType::bf16, DType::u8, DType::i64}) {
      INFO(dev.str() << " " << dtype_name(dt));
      // 40 blocks (more than a CUDA launch takes, 32), each rows x cols into
      // a destination of rows x (cols + gap), some empty, some one run.
      std::vector<Tensor> src, dst, want;
      std::vector<CopyBlock> list;
      for (int b = 0; b < 40; ++b) {
        const int64_t rows = b % 7 == 3 ? 0 : 1 + b % 5, cols = b % 11 == 4 ? 0 : 1 + (b * 13) % 40;
        const int64_t gap = b % 3 == 0 ? 0 : 1 + b % 4;
        src.push_back((randn({rows, cols}, gen) * 50.0).to(dt).to(dev));
        dst.push_back(full({rows, cols + gap}, 7.0, {.dtype = dt, .device = dev}));
        want.push_back(dst.back().clone());
        if (rows * cols > 0) copy_(slice(want.back(), 1, 0, cols), src.back());
        list.push_back({src.back().raw_data(), dst.back().raw_data(), rows, cols, cols + gap});
      }
      kernels(dev).copy_blocks(dt, {list.data(), static_cast<int64_t>(list.size())});
      for (size_t b = 0; b < list.size(); ++b) CHECK(same_bytes(dst[b], want[b]));
      kernels(dev).copy_blocks(dt, {nullptr, 0});  // nothing to copy
    }
  }
}

TEST_CASE("CPU gemm: products cut into row blocks per thread are right for every layout") {
  // Products between 2^17 and 2^20 multiply-adds run on Eigen cut into row
  // blocks, one per thread (engine/cpu/gemm.cpp): every thread count and both
  // layouts of A agree with a plain f64 loop.
  const int before = num_threads();
  Generator gen(5);
  struct Shape3 {
    int64_t m, n, k;
  };
  for (DType dt : {DType::f32, DType::f64}) {
    for (const Shape3 s : {Shape3{37, 64, 300}, Shape3{6, 40, 900}, Shape3{64, 16, 1000},
                           Shape3{5, 2, 20000}, Shape3{3, 300, 700}}) {
      const Tensor a = randn({s.m, s.k}, gen, {.dtype = dt});
      const Tensor b = randn({s.k, s.n}, gen, {.dtype = dt});
      const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
      std::vector<double> want(static_cast<size_t>(s.m * s.n), 0.0);
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t p = 0; p < s.k; ++p)
          for (int64_t j = 0; j < s.n; ++j)
            want[size_t(i * s.n + j)] += av[size_t(i * s.k + p)] * bv[size_t(p * s.n + j)];
      const Tensor at = contiguous(a.t());  // [k, m]: A read column-major
      const double tol = dt == DType::f32 ? 1e-4 : 1e-11;
      for (int threads : {1, 2, 3}) {
        set_num_threads(threads);
        for (const Tensor& got : {matmul(a, b), matmul(at.t(), b)}) {
          INFO(dtype_name(dt) << " " << s.m << "x" << s.n << "x" << s.k << ", " << threads
                              << " threads");
          const std::vector<double> g = got.to_vector<double>();
          double worst = 0;
          for (size_t e = 0; e < g.size(); ++e)
            worst = std::max(worst, std::abs(g[e] - want[e]) / (1.0 + std::abs(want[e])));
          CHECK(worst < tol * std::sqrt(double(s.k)));
        }
      }
      set_num_threads(before);
    }
  }
}

TEST_CASE("CPU gemm: large products (the BLAS backends) are right for every layout") {
  // From 2^20 multiply-adds f32 products go to oneDNN (or OpenBLAS) and f64
  // ones to OpenBLAS, where the build has them: both operand layouts, padded
  // leading dimensions, accumulation into C, and calls from inside a parallel
  // region (one per thread) agree with a plain f64 loop.
  Generator gen(6);
  const int64_t m = 130, n = 96, k = 170;  // 2.1M multiply-adds
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor a = randn({m, k}, gen, {.dtype = DType::f64});
    const Tensor b = randn({k, n}, gen, {.dtype = DType::f64});
    const Tensor c0 = randn({m, n}, gen, {.dtype = DType::f64});
    const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>(),
                              cv = c0.to_vector<double>();
    const std::vector<double> product = naive_product(av, bv, m, n, k);
    const double tol = dt == DType::f32 ? 1e-4 : 1e-11;
    // Each operand stored row-major or column-major with padded leading
    // dimensions.
    for_each_gemm_call([&](const GemmCall& gc) {
      INFO(dtype_name(dt) << describe(gc));
      std::vector<double> as, bs;
      const auto [ars, acs] = stored(av, m, k, gc.a_col, as);
      const auto [brs, bcs] = stored(bv, k, n, gc.b_col, bs);
      const int64_t ldc = n + 5;
      std::vector<double> worst_per_call(2, 0.0);
      run_calls(gc, [&](int call) {
        std::vector<double> c(size_t(m * ldc), 0.0);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) c[size_t(i * ldc + j)] = cv[size_t(i * n + j)];
        if (dt == DType::f32) {
          std::vector<float> af(as.begin(), as.end()), bf(bs.begin(), bs.end()),
              cf(c.begin(), c.end());
          cpu::gemm<float>(m, n, k, {af.data(), ars, acs}, {bf.data(), brs, bcs}, cf.data(), ldc,
                           gc.accumulate);
          c.assign(cf.begin(), cf.end());
        } else {
          cpu::gemm<double>(m, n, k, {as.data(), ars, acs}, {bs.data(), brs, bcs}, c.data(), ldc,
                            gc.accumulate);
        }
        double worst = 0;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const double want =
                product[size_t(i * n + j)] + (gc.accumulate ? cv[size_t(i * n + j)] : 0.0);
            worst =
                std::max(worst, std::abs(c[size_t(i * ldc + j)] - want) / (1.0 + std::abs(want)));
          }
        worst_per_call[size_t(call)] = worst;
      });
      for (int call = 0; call < gc.calls(); ++call)
        CHECK(worst_per_call[size_t(call)] < tol * std::sqrt(double(k)));
    });
  }
}

TEST_CASE("CPU gemm: bf16 products (oneDNN) are right for every layout and size") {
  // bf16 operands, f32 sums: against an f64 loop over the same bf16 values,
  // from a single multiply-add to a large product, both operand layouts,
  // padded leading dimensions, accumulation (onto an output past 2^18
  // elements through scratch and a pass), calls inside a parallel region.
  if (!testing::bf16_products_or_skip("bf16_products_forced")) return;
  Generator gen(7);
  struct Dims {
    int64_t m, n, k;
  };
  for (const Dims d :
       {Dims{1, 1, 1}, Dims{1, 37, 20}, Dims{19, 1, 33}, Dims{130, 96, 170}, Dims{520, 530, 24}}) {
    const auto [m, n, k] = d;
    // Values that bf16 holds exactly, so the reference sees the same operands.
    const std::vector<double> av = randn({m, k}, gen).to(DType::bf16).to_vector<double>();
    const std::vector<double> bv = randn({k, n}, gen).to(DType::bf16).to_vector<double>();
    const std::vector<double> cv = randn({m, n}, gen).to_vector<double>();
    const std::vector<double> product = naive_product(av, bv, m, n, k);
    for_each_gemm_call([&](const GemmCall& gc) {
      INFO(m << "x" << n << "x" << k << describe(gc));
      std::vector<bf16> as, bs;
      const auto [ars, acs] = stored(av, m, k, gc.a_col, as);
      const auto [brs, bcs] = stored(bv, k, n, gc.b_col, bs);
      const int64_t ldc = n + 5;
      std::vector<double> worst(2, 0.0);
      std::vector<int> padding_kept(2, 1);
      run_calls(gc, [&](int call) {
        std::vector<float> c(size_t(m * ldc), 3.5f);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) c[size_t(i * ldc + j)] = float(cv[size_t(i * n + j)]);
        cpu::gemm_bf16(m, n, k, {as.data(), ars, acs}, {bs.data(), brs, bcs}, c.data(), ldc,
                       gc.accumulate);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            const double want =
                product[size_t(i * n + j)] + (gc.accumulate ? cv[size_t(i * n + j)] : 0.0);
            worst[size_t(call)] =
                std::max(worst[size_t(call)],
                         std::abs(c[size_t(i * ldc + j)] - want) / (1.0 + std::abs(want)));
          }
          // The padding past n is left alone.
          for (int64_t j = n; j < ldc; ++j)
            if (c[size_t(i * ldc + j)] != 3.5f) padding_kept[size_t(call)] = 0;
        }
      });
      for (int call = 0; call < gc.calls(); ++call) {
        CHECK(worst[size_t(call)] < 1e-5 * std::sqrt(double(k)));
        CHECK(padding_kept[size_t(call)] == 1);
      }
    });
  }
}

TEST_CASE(
    "CPU gemm: round_to_bf16 and round_to_bf16_values round to nearest even on their vector body "
    "and their tail") {
  Generator gen(8);
  const std::vector<float> src = (randn({37}, gen) * 1000.0).to_vector<float>();
  std::vector<bf16> got(src.size());
  cpu::round_to_bf16(src.data(), int64_t(src.size()), got.data());
  for (size_t i = 0; i < src.size(); ++i) CHECK(float(got[i]) == float(bf16(src[i])));
  // Ties go to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
  const float tie[17] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256};
  bf16 out[17];
  cpu::round_to_bf16(tie, 17, out);
  CHECK(float(out[0]) == 1.0f);
  CHECK(float(out[1]) == 1.0f + 4.0f / 256);
  // Subnormals, NaNs of either sign, infinities, a value that rounds up to
  // infinity and signed zeros round as bf16() does, in the vector body (the
  // first 16) as in the tail: the same bits.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float special[] = {1e-40f,
                           -1e-40f,
                           3e-39f,
                           std::numeric_limits<float>::denorm_min(),
                           nan,
                           -nan,
                           inf,
                           -inf,
                           3.4e38f,
                           -0.0f,
                           0.0f,
                           std::numeric_limits<float>::min(),
                           1.5e-40f,
                           -2.7e-39f,
                           1.0f + 3.0f / 256,
                           -7.0f};
  std::vector<float> twice(special, special + 16);
  twice.insert(twice.end(), special, special + 16);
  std::vector<bf16> rounded(twice.size());
  cpu::round_to_bf16(twice.data(), 16 + 15, rounded.data());  // the second copy in the tail
  for (size_t i = 0; i < 16 + 15; ++i) {
    CAPTURE(i);
    const bf16 want(twice[i]);
    CHECK(std::memcmp(&rounded[i], &want, sizeof want) == 0);
  }
  CHECK(float(rounded[0]) != 0.0f);  // a subnormal is kept, not flushed
  // The same values kept in f32: float(bf16(x))'s bits, into another
  // buffer and in place.
  std::vector<float> values(twice.size()), in_place = twice;
  cpu::round_to_bf16_values(twice.data(), 16 + 15, values.data());
  cpu::round_to_bf16_values(in_place.data(), 16 + 15, in_place.data());
  for (size_t i = 0; i < 16 + 15; ++i) {
    CAPTURE(i);
    const float want = float(bf16(twice[i]));
    CHECK(std::memcmp(&values[i], &want, sizeof want) == 0);
    CHECK(std::memcmp(&in_place[i], &want, sizeof want) == 0);
  }
  std::vector<float> random_values(src.size());
  cpu::round_to_bf16_values(src.data(), int64_t(src.size()), random_values.data());
  for (size_t i = 0; i < src.size(); ++i) CHECK(random_values[i] == float(got[i]));
}

namespace {

// group_norm's entries against plain f64 loops over x [batch, channels,
// spatial] stored in g's layout.
struct NormReference {
  std::vector<double> y, mean, rstd, gx, gw, gb;
};

NormReference norm_reference(const NormGeom& g, double eps, const std::vector<double>& x,
                             const std::vector<double>& w, const std::vector<double>& b,
                             const std::vector<double>& gy) {
  const auto at = [&](int64_t item, int64_t c, int64_t s) {
    return g.channels_last ? (item * g.spatial + s) * g.channels + c
                           : (item * g.channels + c) * g.spatial + s;
  };
  NormReference r;
  r.y.assign(x.size(), 0), r.gx.assign(x.size(), 0);
  r.gw.assign(g.channels, 0), r.gb.assign(g.channels, 0);
  const int64_t cg = g.channels / g.groups, m = cg * g.spatial;
  for (int64_t item = 0; item < g.batch; ++item)
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      double sum = 0, sq = 0, sum_g = 0, sum_gx = 0;
      for (int64_t c = grp * cg; c < (grp + 1) * cg; ++c)
        for (int64_t s = 0; s < g.spatial; ++s) sum += x[at(item, c, s)];
      const double mu = m ? sum / m : 0;
      for (int64_t c = grp * cg; c < (grp + 1) * cg; ++c)
        for (int64_t s = 0; s < g.spatial; ++s)
          sq += (x[at(item, c, s)] - mu) * (x[at(item, c, s)] - mu);
      const double rs = 1 / std::sqrt((m ? sq / m : 0) + eps);
      r.mean.push_back(mu), r.rstd.push_back(rs);
      for (int64_t c = grp * cg; c < (grp + 1) * cg; ++c)
        for (int64_t s = 0; s < g.spatial; ++s) {
          const int64_t o = at(item, c, s);
          const double xhat = (x[o] - mu) * rs, gs = gy[o] * (w.empty() ? 1 : w[c]);
          r.y[o] = xhat * (w.empty() ? 1 : w[c]) + (b.empty() ? 0 : b[c]);
          sum_g += gs, sum_gx += gs * xhat;
          r.gw[c] += gy[o] * xhat, r.gb[c] += gy[o];
        }
      for (int64_t c = grp * cg; c < (grp + 1) * cg; ++c)
        for (int64_t s = 0; s < g.spatial; ++s) {
          const int64_t o = at(item, c, s);
          const double xhat = (x[o] - mu) * rs, gs = gy[o] * (w.empty() ? 1 : w[c]);
          r.gx[o] = rs * (gs - sum_g / m - xhat * sum_gx / m);
        }
    }
  return r;
}

// The largest difference, relative where a value exceeds 1.
double max_diff(const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> v = got.to(Device::cpu()).to(DType::f64).to_vector<double>();
  REQUIRE(v.size() == want.size());
  double d = 0;
  for (size_t i = 0; i < v.size(); ++i)
    d = std::max(d, std::abs(v[i] - want[i]) / std::max(1.0, std::abs(want[i])));
  return d;
}

}  // namespace

TEST_CASE("group_norm: both layouts, layer norm's geometry, affine or not, every device") {
  Generator gen(43);
  // Small groups, layer norm's rows, a group wider than a CUDA block, a batch
  // long enough for CUDA to cut the affine sums into pieces, and empties.
  const std::vector<NormGeom> geoms = {
      {.batch = 3, .channels = 6, .spatial = 5, .groups = 2},
      {.batch = 3, .channels = 6, .spatial = 5, .groups = 2, .channels_last = true},
      {.batch = 7, .channels = 9, .spatial = 1, .groups = 1},
      {.batch = 2, .channels = 4, .spatial = 700, .groups = 1},
      {.batch = 2, .channels = 8, .spatial = 70, .groups = 4, .channels_last = true},
      {.batch = 300, .channels = 4, .spatial = 1, .groups = 1},
      {.batch = 0, .channels = 4, .spatial = 3, .groups = 2},
      {.batch = 2, .channels = 4, .spatial = 0, .groups = 2},
  };
  const double eps = 1e-5;
  for (const NormGeom& g : geoms) {
    const int64_t n = g.batch * g.channels * g.spatial;
    const Tensor x0 = randn({n}, gen, {.dtype = DType::f64}) * 3.0 + 1.0;
    const Tensor gy0 = randn({n}, gen, {.dtype = DType::f64});
    // Affine parameters that f32 holds exactly, so one reference serves both.
    const Tensor w0 = randn({g.channels}, gen, {.dtype = DType::f32}).to(DType::f64);
    const Tensor b0 = randn({g.channels}, gen, {.dtype = DType::f32}).to(DType::f64);
    for (const bool affine : {true, false}) {
      const std::vector<double> wv = affine ? w0.to_vector<double>() : std::vector<double>{};
      const std::vector<double> bv = affine ? b0.to_vector<double>() : std::vector<double>{};
      for (const DType dt : {DType::f64, DType::f32}) {
        // From the inputs as the dtype holds them.
        const auto held = [dt](const Tensor& t) { return t.to(dt).to(DType::f64); };
        const NormReference want = norm_reference(g, eps, held(x0).to_vector<double>(), wv, bv,
                                                  held(gy0).to_vector<double>());
        Tensor cpu_y, cpu_gx, cpu_gw;
        for (const Device dev : testing::cpu_and_test_devices()) {
          INFO(dev.str() << " " << std::string(dtype_name(dt)) << " batch " << g.batch
                         << " channels " << g.channels << " spatial " << g.spatial << " groups "
                         << g.groups << std::string(g.channels_last ? " channels last" : "")
                         << std::string(affine ? " affine" : ""));
          const TensorOptions opts{.dtype = dt, .device = dev};
          const Tensor x = x0.to(dt).to(dev), gy = gy0.to(dt).to(dev);
          const Tensor w = w0.to(dt).to(dev), b = b0.to(dt).to(dev);
          const Tensor y = empty({n}, opts), mean = empty({g.group_count()}, opts),
                       rstd = empty({g.group_count()}, opts);
          const KernelTable& k = kernels(dev);
          k.group_norm(dt, g, eps, x.raw_data(), affine ? w.raw_data() : nullptr,
                       affine ? b.raw_data() : nullptr, y.raw_data(), mean.raw_data(),
                       rstd.raw_data());
          // Relative to the values' scale (about 1 to 5).
          const double tol = dt == DType::f64 ? 1e-11 : 2e-5;
          CHECK(max_diff(y, want.y) < tol);
          CHECK(max_diff(mean, want.mean) < tol * 4);
          CHECK(max_diff(rstd, want.rstd) < tol);
          // The input gradient added onto ones, and the affine gradients.
          const Tensor gx = full({n}, 1.0, opts);
          const Tensor gw = empty({g.channels}, opts), gb = empty({g.channels}, opts);
          k.group_norm_grad(dt, g, x.raw_data(), affine ? w.raw_data() : nullptr, mean.raw_data(),
                            rstd.raw_data(), gy.raw_data(), gx.raw_data(), gw.raw_data(),
                            gb.raw_data(), /*accumulate_gx=*/true);
          std::vector<double> gx_want = want.gx;
          for (double& v : gx_want) v += 1;
          CHECK(max_diff(gx, gx_want) < tol * 10);
          CHECK(max_diff(gw, want.gw) < tol * std::max<int64_t>(1, g.batch * g.spatial));
          CHECK(max_diff(gb, want.gb) < tol * std::max<int64_t>(1, g.batch * g.spatial));
          // The input's written afresh, alone; then the weight's alone.
          const Tensor gx2 = full({n}, 7.0, opts);
          k.group_norm_grad(dt, g, x.raw_data(), affine ? w.raw_data() : nullptr, mean.raw_data(),
                            rstd.raw_data(), gy.raw_data(), gx2.raw_data(), nullptr, nullptr,
                            false);
          CHECK(max_diff(gx2, want.gx) < tol * 10);
          k.group_norm_grad(dt, g, x.raw_data(), nullptr, mean.raw_data(), rstd.raw_data(),
                            gy.raw_data(), nullptr, gw.raw_data(), nullptr, false);
          CHECK(max_diff(gw, want.gw) < tol * std::max<int64_t>(1, g.batch * g.spatial));
          // sim queues the CPU's kernels: the CPU's bits.
          if (dev.is_cpu()) {
            cpu_y = y, cpu_gx = gx, cpu_gw = gw;
          } else if (dev.is_sim()) {
            CHECK(same_bytes(y, cpu_y));
            CHECK(same_bytes(gx, cpu_gx));
            CHECK(same_bytes(gw, cpu_gw));
          }
        }
      }
    }
  }
}
