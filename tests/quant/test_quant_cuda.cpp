// The CUDA quantizer table (quant/cuda/): the math it shares with the CPU
// (quant/kernels/functors.h) and its host-side plans (quant/cuda/plans.h)
// checked on the CPU, then every entry on cuda:0 against the CPU table on the
// same inputs (indices and NF4 bytes equal, values within each dtype's
// tolerance), skipped with one line where no GPU is present.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "quant/cuda/plans.h"
#include "quant/kernels/code_stats_pieces.h"
#include "quant/kernels/entropy_walk.h"
#include "quant/kernels/functors.h"
#include "quant/kernels/table.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quant/nf4/nf4_linear.h"
#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::quant;
namespace qfn = quanta::quant::fn;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// The contract's rule, written plainly: the first index of the smallest
// non-NaN score, 0 when there is none.
int64_t rule_argmin(const std::vector<double>& row) {
  int64_t best = -1;
  for (size_t j = 0; j < row.size(); ++j)
    if (!std::isnan(row[j]) && (best < 0 || row[j] < row[static_cast<size_t>(best)]))
      best = static_cast<int64_t>(j);
  // The scan starts from +inf: a row whose best is +inf gives 0 too.
  if (best < 0 || row[static_cast<size_t>(best)] == kInf) return 0;
  return best;
}

// The CUDA kernel's scan: 32 lanes each offered every 32nd score, merged in
// a butterfly, then across two tiles.
int64_t lane_argmin(const std::vector<double>& row, size_t split) {
  auto tile = [&](size_t lo, size_t hi) {
    std::vector<qfn::ArgMin<double>> lanes(32);
    for (size_t j = lo; j < hi; ++j)
      qfn::argmin_offer(lanes[(j - lo) % 32], row[j], static_cast<int64_t>(j));
    for (int o = 16; o > 0; o /= 2)
      for (int l = 0; l < 32; ++l)
        if ((l ^ o) > l) lanes[l] = qfn::argmin_merge(lanes[l], lanes[l ^ o]);
    return lanes[0];
  };
  return qfn::argmin_result(qfn::argmin_merge(tile(0, split), tile(split, row.size())));
}

std::vector<double> random_values(size_t n, unsigned seed, double lo = -1, double hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

}  // namespace

// ---- the shared math and the plans, on the CPU ----

TEST_CASE("quant functors: the argmin keeps the first of ties and never picks NaN") {
  const std::vector<std::vector<double>> rows = {
      {3, 1, 2, 1},
      {kNaN, kNaN, kNaN},
      {kInf, kInf},
      {kNaN, kInf, -kInf, -kInf},
      {5, kNaN, 5, 4, 4, kNaN},
  };
  for (const auto& row : rows) {
    qfn::ArgMin<double> serial;
    for (size_t j = 0; j < row.size(); ++j)
      qfn::argmin_offer(serial, row[j], static_cast<int64_t>(j));
    CHECK(qfn::argmin_result(serial) == rule_argmin(row));
    for (size_t split = 0; split <= row.size(); ++split)
      CHECK(lane_argmin(row, split) == rule_argmin(row));
  }
  // Long rows with repeated values: every lane and tile boundary.
  std::vector<double> row(200);
  for (size_t j = 0; j < row.size(); ++j) row[j] = double((j * 37) % 11);
  row[150] = kNaN;
  for (size_t split : {0, 1, 31, 32, 33, 100, 200})
    CHECK(lane_argmin(row, split) == rule_argmin(row));
}

TEST_CASE("quant functors: bit products are the CPU table's") {
  for (int64_t k = 0; k <= 6; ++k) {
    const int64_t rows = 3, n = int64_t(1) << k;
    const std::vector<double> pi = random_values(static_cast<size_t>(rows * 2 * k), 7 + k, 0, 1);
    const std::vector<double> gP = random_values(static_cast<size_t>(rows * n), 9 + k);
    std::vector<double> out(static_cast<size_t>(rows * n)), grad(static_cast<size_t>(rows * 2 * k));
    quant_cpu::table().bit_product(DType::f64, pi.data(), rows, k, out.data());
    quant_cpu::table().bit_product_grad(DType::f64, pi.data(), gP.data(), rows, k, grad.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < n; ++c)
        CHECK(qfn::bit_product_at(pi.data() + r * 2 * k, k, c) == out[r * n + c]);
      for (int64_t j = 0; j < k; ++j) {
        double g2[2];
        qfn::bit_product_grad_at(pi.data() + r * 2 * k, k, gP.data() + r * n, j, g2);
        // The same sums in the same order; only where a compiler fuses a
        // multiply-add may differ (g++ and nvcc both may), so within 1e-14.
        CHECK(g2[0] == doctest::Approx(grad[r * 2 * k + 2 * j]).epsilon(1e-14));
        CHECK(g2[1] == doctest::Approx(grad[r * 2 * k + 2 * j + 1]).epsilon(1e-14));
      }
    }
  }
}

TEST_CASE("quant functors: NF4 codes, midpoints and scaling are the format's") {
  for (int i = 0; i < 15; ++i) CHECK(qfn::nf4_midpoint(i) == nf4_midpoints()[i]);
  auto counted = [](float v) {
    int c = 0;
    for (float m : nf4_midpoints()) c += v > m ? 1 : 0;
    return c;
  };
  std::vector<float> probes = {-1.0f, 1.0f, 0.0f, -0.0f, std::nanf("")};
  for (float m : nf4_midpoints())
    probes.insert(probes.end(), {m, std::nextafter(m, 2.0f), std::nextafter(m, -2.0f)});
  for (double v : random_values(2000, 5)) probes.push_back(static_cast<float>(v));
  for (float v : probes) CHECK(qfn::nf4_code(v) == counted(v));
  CHECK(qfn::nf4_code(0.0f) == kNF4ZeroCode);
  CHECK(qfn::nf4_code(1.0f) == 15);
  CHECK(qfn::nf4_code(-1.0f) == 0);

  CHECK(qfn::nf4_block_scale(0.0f) == qfn::kNF4MinScale);
  CHECK(qfn::nf4_block_scale(3.0f) == 3.0f);
  CHECK(qfn::nf4_scaled(5.0f, 2.0f, 0.5f, true) == 1.0f);
  CHECK(qfn::nf4_scaled(-5.0f, 2.0f, 0.5f, false) == -1.0f);
  CHECK(qfn::nf4_scaled(1.0f, 3.0f, 1.0f / 3.0f, false) == 1.0f / 3.0f);
  CHECK(std::isnan(qfn::nf4_scaled(std::nanf(""), 1.0f, 1.0f, true)));
  CHECK(qfn::nf4_absmax_step(2.0f, std::nanf("")) == 2.0f);
  CHECK(qfn::nf4_absmax_step(2.0f, -3.0f) == 3.0f);
}

TEST_CASE("quant functors: run codes and scales read both NF4 layouts as NF4Runs does") {
  std::vector<uint8_t> units(3 * kNF4UnitBytes);
  for (size_t i = 0; i < units.size(); ++i) units[i] = static_cast<uint8_t>(i * 7);
  const NF4Runs u = nf4_unit_runs(units.data(), 150);
  std::vector<uint8_t> packed(80);
  const std::vector<float> scales = {0.5f, 1.5f, 2.5f};
  const NF4Runs p = nf4_packed_runs(packed.data(), scales.data(), 160, 128);
  const NF4Runs b32 = nf4_packed_runs(packed.data(), scales.data(), 96, 32);
  for (const NF4Runs* w : {&u, &p})
    for (int64_t r = 0; r < w->runs(); ++r) {
      CHECK(qfn::nf4_run_codes(*w, r) == w->codes_of(r));
      CHECK(qfn::nf4_run_scale(*w, r) == w->scale_of(r));
    }
  for (const NF4Runs* w : {&u, &p, &b32})
    for (int64_t i = 0; i < w->n; ++i) CHECK(qfn::nf4_run_of(*w, i) == i / w->run);
  const uint8_t byte[1] = {0xA3};
  CHECK(qfn::nf4_nibble(byte, 0) == 0xA);
  CHECK(qfn::nf4_nibble(byte, 1) == 0x3);
  // The GEMV's 32-bit words of 4 packed bytes give each code nf4_nibble gives.
  const uint8_t four[4] = {0xA3, 0x5F, 0x07, 0xC1};
  uint32_t word = 0;
  std::memcpy(&word, four, 4);  // little-endian, as the GPU loads it
  for (int j = 0; j < 8; ++j) CHECK(qfn::nf4_word_code(word, j) == qfn::nf4_nibble(four, j));
  for (int c = 0; c < 16; ++c) CHECK(qfn::nf4_value(c) == kNF4Values[static_cast<size_t>(c)]);
}

TEST_CASE("quant cuda plans: tiles stay within their budgets and cover the work") {
  using namespace quant_cuda;
  CHECK(nearest_tiles(0, 5).rows == 0);
  CHECK(nearest_tiles(5, 0).codes == 0);
  const NearestTiles small = nearest_tiles(100, 50, 1000);
  CHECK(small.codes == 50);
  CHECK(small.rows == 20);
  const NearestTiles big = nearest_tiles(10, 5000, 1000);
  CHECK(big.codes == 1000);
  CHECK(big.rows == 1);
  const NearestTiles wide = nearest_tiles(8192, 16384);
  CHECK(wide.codes == kNearestMaxCodes);
  CHECK(wide.rows * wide.codes <= kNearestTileElems);
  CHECK(nearest_tiles(3, 10).rows == 3);

  CHECK(nf4_tile_rows(0, 64) == 0);
  CHECK(nf4_tile_rows(10, 0) == 0);
  CHECK(nf4_tile_rows(10, 64, 256) == 4);
  CHECK(nf4_tile_rows(10, 1000, 256) == 1);
  CHECK(nf4_tile_rows(3, 64) == 3);
  CHECK(nf4_tile_rows(100000, 4096) * 4096 <= kNF4GpuTileElems);

  CHECK(squared_error_chunks(0) == 0);
  CHECK(squared_error_chunks(1) == 1);
  CHECK(squared_error_chunks(256) == 1);
  CHECK(squared_error_chunks(257) == 2);
}

TEST_CASE("quant cuda plans: the NF4 GEMV takes small batches of whole runs, in its budget") {
  using namespace quant_cuda;
  alignas(8) static uint8_t bytes[4 * kNF4UnitBytes];
  const NF4Runs units = nf4_unit_runs(bytes, 4 * 64);
  CHECK(nf4_use_gemv(1, 128, 2, units));
  CHECK(nf4_use_gemv(kNF4GemvMaxBatch, 64, 3, units));
  CHECK_FALSE(nf4_use_gemv(kNF4GemvMaxBatch + 1, 64, 3, units));  // the tiled path
  CHECK_FALSE(nf4_use_gemv(0, 64, 3, units));
  CHECK_FALSE(nf4_use_gemv(1, 0, 3, units));
  CHECK_FALSE(nf4_use_gemv(1, 96, 2, units));  // rows would start inside a run
  CHECK_FALSE(nf4_use_gemv(1, 64, 2, nf4_unit_runs(bytes + 2, 128)));  // unaligned words
  const float scales[8] = {};
  CHECK(nf4_use_gemv(2, 96, 2, nf4_packed_runs(bytes, scales, 192, 32)));  // block 32: runs of 32
  CHECK(nf4_use_gemv(2, 128, 2, nf4_packed_runs(bytes, scales, 256, 128)));
  CHECK_FALSE(nf4_use_gemv(2, 96, 2, nf4_packed_runs(bytes, scales, 192, 64)));

  CHECK(nf4_gemv_plan(0, 64, 8, 4).blocks == 0);
  CHECK(nf4_gemv_plan(1, 64, 0, 4).blocks == 0);
  for (int64_t e : {4, 8}) {
    // Every lane's 8 staged values start on 16 bytes, and the 8 lanes of one
    // 16-byte load phase start in 8 different bank groups.
    std::vector<int> seen(8, 0);
    for (int64_t lane = 0; lane < 8; ++lane) {
      const int64_t at = nf4_gemv_slot(8 * lane, e) * e;
      CHECK(at % 16 == 0);
      ++seen[static_cast<size_t>(at / 16 % 8)];
    }
    CHECK(std::count(seen.begin(), seen.end(), 1) == 8);
    for (int64_t m = 1; m <= kNF4GemvMaxBatch; ++m)
      for (int64_t k : {64, 256, 320, 4096, 8192, 65536})
        for (int64_t n : {int64_t{1}, int64_t{16}, int64_t{17}, int64_t{8192}, int64_t{1} << 22}) {
          CAPTURE(e);
          CAPTURE(m);
          CAPTURE(k);
          CAPTURE(n);
          const NF4GemvPlan p = nf4_gemv_plan(m, k, n, e);
          CHECK(p.chunk % kNF4GemvStep == 0);
          CHECK(p.chunk >= kNF4GemvStep);
          CHECK(p.chunk < k + kNF4GemvStep);  // never more than one partial step past k
          CHECK(p.smem_bytes == m * nf4_gemv_slot(p.chunk, e) * e);
          CHECK(p.smem_bytes <= kNF4GemvSmemBytes);
          CHECK(p.blocks >= 1);
          CHECK(p.blocks <= kNF4GemvMaxBlocks);
          CHECK((p.blocks == kNF4GemvMaxBlocks || p.blocks * kNF4GemvBlockRows >= n));
        }
  }
  // One row of x of 8192 f32 values: two passes of at most 32 KiB.
  CHECK(nf4_gemv_plan(1, 8192, 8192, 4).chunk == 21 * kNF4GemvStep);
  CHECK(nf4_gemv_plan(1, 8192, 8192, 4).blocks == 8192 / kNF4GemvBlockRows);
}

TEST_CASE("quant cuda plans: nf4_decode takes whole aligned words, the rest element by element") {
  using namespace quant_cuda;
  alignas(16) static uint8_t bytes[8 * kNF4UnitBytes];
  alignas(16) static float out[8];
  const float scales[8] = {};
  const NF4Runs units = nf4_unit_runs(bytes, 8 * 64);
  const auto check = [](const NF4DecodeSplit& s, int64_t words, int64_t tail_begin,
                        int64_t tail_count) {
    CHECK(s.words == words);
    CHECK(s.tail_begin == tail_begin);
    CHECK(s.tail_count == tail_count);
  };
  check(nf4_decode_split(units, 0, 512, out), 64, 512, 0);
  check(nf4_decode_split(units, 64, 203, out), 25, 264, 3);  // a partial last word
  check(nf4_decode_split(units, 0, 5, out), 0, 0, 5);        // less than a word
  check(nf4_decode_split(units, 4, 100, out), 0, 4, 100);    // begin inside a word
  check(nf4_decode_split(units, 0, 64, out + 1), 0, 0, 64);  // output not on 16 bytes
  check(nf4_decode_split(nf4_unit_runs(bytes + 2, 128), 0, 128, out), 0, 0, 128);  // codes
  check(nf4_decode_split(nf4_packed_runs(bytes, scales, 96, 32), 0, 96, out), 12, 96, 0);
  check(nf4_decode_split(units, 0, 0, out), 0, 0, 0);
  CHECK(nf4_word_aligned(units));
  CHECK_FALSE(nf4_word_aligned(nf4_packed_runs(bytes + 1, scales, 96, 32)));
  // A word never straddles two runs, so one scale serves its 8 codes.
  static_assert(32 % kNF4WordCodes == 0 && 64 % kNF4WordCodes == 0);
}

TEST_CASE("quant cuda plans: code_statistics' pieces are about sqrt(n) rows, powers of two") {
  using namespace quant_cuda;
  CHECK(code_stats_piece_rows(0) == 32);
  CHECK(code_stats_piece_rows(1000) == 32);
  CHECK(code_stats_piece_rows(1025) == 64);
  CHECK(code_stats_piece_rows(65536) == 256);
  CHECK(code_stats_piece_rows(int64_t{1} << 30) == 1024);  // the cap: 8 KiB of staged keys
  for (int64_t n : {1, 33, 3136, 100000, 1 << 22}) {
    const int64_t p = code_stats_piece_rows(n);
    CHECK((p & (p - 1)) == 0);
    CHECK((p == 1024 || p * p >= n));
    CHECK((p == 32 || (p / 2) * (p / 2) < n));
  }
  CHECK(code_stats_threads(1) == 32);
  CHECK(code_stats_threads(64) == 64);
  CHECK(code_stats_threads(65) == 96);
  CHECK(code_stats_threads(4096) == 256);
}

// ---- the CUDA axis: every entry against the CPU table ----

namespace {

using testing::have_gpu;

Tensor on_gpu(const Tensor& t) { return t.contiguous().to(Device::cuda(0)); }

// Either side may be on the GPU (runs of the same kernel are compared too).
bool same_bytes(const Tensor& got, const Tensor& want) {
  const Tensor a = got.to(Device::cpu()).contiguous(), b = want.to(Device::cpu()).contiguous();
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// max |got - want| / max(1, max |want|), NaN-aware (NaN matches NaN).
double max_err(const Tensor& got, const Tensor& want) {
  const auto a = got.to(Device::cpu()).to(DType::f64).to_vector<double>();
  const auto b = want.to(DType::f64).to_vector<double>();
  REQUIRE(a.size() == b.size());
  double scale = 1, err = 0;
  for (double v : b) scale = std::max(scale, std::isfinite(v) ? std::fabs(v) : 0.0);
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    err = std::max(err, std::isnan(a[i] - b[i]) ? kInf : std::fabs(a[i] - b[i]));
  }
  return err / scale;
}

double tol(DType t) { return t == DType::f64 ? 1e-10 : 2e-5; }

const QuantKernelTable& cpu_t() { return quant_cpu::table(); }
const QuantKernelTable& gpu_t() { return quant_kernels(Device::cuda(0)); }

Tensor random_tensor(const Shape& s, DType t, uint64_t seed) {
  Generator gen(seed);
  return randn(s, gen).to(t);
}

Tensor row_mask(int64_t rows, uint64_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(rows));
  std::mt19937 rng(static_cast<unsigned>(seed));
  for (uint8_t& b : v) b = rng() % 3 == 0 ? 0 : 1;
  return from_vector<uint8_t>(v, {rows});
}

#define SKIP_WITHOUT_GPU()                            \
  if (!have_gpu()) {                                  \
    MESSAGE("skipped: " << testing::no_gpu_reason()); \
    return;                                           \
  }

// x's codes in NF4 units (block 64), encoded by the CPU table.
Tensor cpu_units(const Tensor& x) {
  const int64_t n = x.numel(), runs = (n + 63) / 64;
  Tensor absmax = empty({runs});
  Tensor units = zeros({runs * static_cast<int64_t>(kNF4UnitBytes)}, {.dtype = DType::u8});
  cpu_t().nf4_absmax(x.data<float>(), n, 64, absmax.data<float>());
  const NF4RunsOut out{.run = 64,
                       .codes = units.data<uint8_t>(),
                       .code_stride = static_cast<int64_t>(kNF4UnitBytes),
                       .pad_runs = true,
                       .scales = units.data<uint8_t>() + kNF4CodeBytes,
                       .scale_stride = static_cast<int64_t>(kNF4UnitBytes)};
  cpu_t().nf4_encode(x.data<float>(), n, 64, absmax.data<float>(), absmax.data<float>(), out);
  return units;
}

}  // namespace

TEST_CASE("quant cuda: nearest_codes picks the CPU's indices, ties and NaN rows included") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::f64})
    for (bool cosine : {false, true}) {
      // 5000 codes: two code tiles; integer values: exact scores and real ties.
      for (int64_t k : {7, 5000}) {
        const int64_t n = 300, d = 8;
        Tensor x = round(random_tensor({n, d}, DType::f64, 1) * 2.0).to(dt).contiguous();
        Tensor c = round(random_tensor({k, d}, DType::f64, 2) * 2.0).to(dt);
        c = cat({c, c}, 0).contiguous();  // every code twice: the first must win
        if (dt == DType::f32)
          x.data<float>()[5 * d] = std::nanf("");
        else
          x.data<double>()[5 * d] = kNaN;
        Tensor want = empty({n}, {.dtype = DType::i64});
        Tensor got = empty({n}, {.dtype = DType::i64, .device = Device::cuda(0)});
        cpu_t().nearest_codes(dt, x.raw_data(), c.raw_data(), n, 2 * k, d, cosine,
                              want.data<int64_t>());
        gpu_t().nearest_codes(dt, on_gpu(x).raw_data(), on_gpu(c).raw_data(), n, 2 * k, d, cosine,
                              testing::dev<int64_t>(got));
        INFO(dtype_name(dt), " cosine ", cosine, " k ", k);
        CHECK(same_bytes(got, want));
      }
    }
  // Rows enough for several row tiles.
  const int64_t n = 12000, k = 1500, d = 8;
  Tensor x = random_tensor({n, d}, DType::f32, 3), c = random_tensor({k, d}, DType::f32, 4);
  Tensor want = empty({n}, {.dtype = DType::i64});
  Tensor got = empty({n}, {.dtype = DType::i64, .device = Device::cuda(0)});
  cpu_t().nearest_codes(DType::f32, x.raw_data(), c.raw_data(), n, k, d, false,
                        want.data<int64_t>());
  gpu_t().nearest_codes(DType::f32, on_gpu(x).raw_data(), on_gpu(c).raw_data(), n, k, d, false,
                        testing::dev<int64_t>(got));
  const auto a = got.to(Device::cpu()).to_vector<int64_t>(), b = want.to_vector<int64_t>();
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  CHECK(differ <= 2);  // random scores: only a near-tie may round the other way
}

TEST_CASE("quant cuda: squared_error equals the CPU's and is the same bits every run") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::f64})
    for (bool masked : {false, true}) {
      const int64_t rows = 1000, d = 33;
      Tensor x = random_tensor({rows, d}, dt, 5), q = random_tensor({rows, d}, dt, 6);
      Tensor valid = row_mask(rows, 7);
      const uint8_t* hv = masked ? valid.data<uint8_t>() : nullptr;
      Tensor gvalid = on_gpu(valid), gx = on_gpu(x), gq = on_gpu(q);
      const uint8_t* dv = masked ? testing::dev<uint8_t>(gvalid) : nullptr;
      // Both results stay on the device: [sum, elements] in f64.
      Tensor want = empty({2}, {.dtype = DType::f64});
      Tensor got = empty({2}, {.dtype = DType::f64, .device = Device::cuda(0)});
      Tensor again = empty({2}, {.dtype = DType::f64, .device = Device::cuda(0)});
      cpu_t().squared_error(dt, x.raw_data(), q.raw_data(), hv, rows, d, want.data<double>());
      gpu_t().squared_error(dt, gx.raw_data(), gq.raw_data(), dv, rows, d,
                            testing::dev<double>(got));
      gpu_t().squared_error(dt, gx.raw_data(), gq.raw_data(), dv, rows, d,
                            testing::dev<double>(again));
      const std::vector<double> w = want.to_vector<double>(), g = got.to_vector<double>(),
                                a = again.to_vector<double>();
      CHECK(g[1] == w[1]);
      CHECK(std::fabs(g[0] - w[0]) <= tol(dt) * w[0]);
      CHECK(std::memcmp(&g[0], &a[0], sizeof(double)) == 0);

      const Tensor scale = scalar(0.25, {.dtype = DType::f64});
      const Tensor gscale = on_gpu(scale);
      Tensor gwant = empty({rows, d}, {.dtype = dt});
      Tensor ggot = empty({rows, d}, {.dtype = dt, .device = Device::cuda(0)});
      cpu_t().squared_error_grad(dt, x.raw_data(), q.raw_data(), hv, rows, d, scale.data<double>(),
                                 gwant.raw_data());
      gpu_t().squared_error_grad(dt, gx.raw_data(), gq.raw_data(), dv, rows, d,
                                 testing::dev<double>(gscale), ggot.raw_data());
      CHECK(max_err(ggot, gwant) <= tol(dt));
    }
}

TEST_CASE("quant cuda: route_grad (rotation and straight through) equals the CPU's") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::f64})
    for (bool rotation : {true, false})
      for (bool masked : {false, true}) {
        const int64_t rows = 77, d = 45;
        Tensor x = random_tensor({rows, d}, dt, 8), q = random_tensor({rows, d}, dt, 9);
        Tensor g = random_tensor({rows, d}, dt, 10), valid = row_mask(rows, 11);
        Tensor gvalid = on_gpu(valid);
        const Tensor coef = scalar(0.5, {.dtype = DType::f64}), gcoef = on_gpu(coef);
        Tensor want = empty({rows, d}, {.dtype = dt});
        Tensor got = empty({rows, d}, {.dtype = dt, .device = Device::cuda(0)});
        cpu_t().route_grad(rotation, dt, x.raw_data(), q.raw_data(), g.raw_data(),
                           masked ? valid.data<uint8_t>() : nullptr, coef.data<double>(), rows, d,
                           want.raw_data());
        gpu_t().route_grad(rotation, dt, on_gpu(x).raw_data(), on_gpu(q).raw_data(),
                           on_gpu(g).raw_data(), masked ? testing::dev<uint8_t>(gvalid) : nullptr,
                           testing::dev<double>(gcoef), rows, d, got.raw_data());
        INFO(dtype_name(dt), " rotation ", rotation, " masked ", masked);
        CHECK(max_err(got, want) <= 10 * tol(dt));
      }
}

TEST_CASE("quant cuda: put_rows writes the CPU's rows") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::f64})
    for (bool with_src : {true, false}) {
      Tensor table = random_tensor({20, 7}, dt, 12), src = random_tensor({4, 7}, dt, 13);
      Tensor at = from_vector<int64_t>({3, -1, 11, 0}, {4});  // -1: skipped
      Tensor gtable = on_gpu(table), gsrc = on_gpu(src), gat = on_gpu(at);
      cpu_t().put_rows(dt, table.raw_data(), 7, at.data<int64_t>(), 4,
                       with_src ? src.raw_data() : nullptr, 1.5);
      gpu_t().put_rows(dt, gtable.raw_data(), 7, testing::dev<int64_t>(gat), 4,
                       with_src ? gsrc.raw_data() : nullptr, 1.5);
      CHECK(same_bytes(gtable, table));
    }
}

TEST_CASE("quant functors: the entropy walk's insertion sort is a stable sort by magnitude") {
  std::mt19937 rng(5);
  for (int64_t d : {1, 2, 7, 16, 64}) {
    std::vector<double> a(static_cast<size_t>(d));
    for (double& v : a) v = double(rng() % 6) * 0.5;  // many ties
    std::vector<int64_t> got(a.size()), want(a.size());
    quant::fn::order_by_magnitude(a.data(), d, got.data());
    std::iota(want.begin(), want.end(), int64_t{0});
    std::stable_sort(want.begin(), want.end(), [&](int64_t i, int64_t j) { return a[i] < a[j]; });
    CHECK(got == want);
  }
}

// What code_statistics.cu does, on the CPU: the keys sorted stably, every
// piece walked for every column, then the spanning codes combined.
namespace {

template <class T>
void pieces_on_cpu(const std::vector<int64_t>& idx, const T* x, int64_t k, int64_t d, int64_t P,
                   std::vector<T>& counts, std::vector<T>& sums, std::vector<int>& writes) {
  const int64_t n = static_cast<int64_t>(idx.size());
  std::vector<int32_t> rows(static_cast<size_t>(n)), keys(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows[i] = static_cast<int32_t>(i);
  const auto key_of = [&](int64_t i) {
    return static_cast<int32_t>(idx[i] >= 0 && idx[i] < k ? idx[i] : k);
  };
  std::stable_sort(rows.begin(), rows.end(),
                   [&](int32_t a, int32_t b) { return key_of(a) < key_of(b); });
  for (int64_t t = 0; t < n; ++t) keys[t] = key_of(rows[t]);
  const int64_t pieces = (n + P - 1) / P;
  std::vector<T> head(static_cast<size_t>(pieces * d)), tail(static_cast<size_t>(pieces * d));
  sums.assign(static_cast<size_t>(k * d), T(-12345));
  writes.assign(static_cast<size_t>(k * d), 0);
  for (int64_t j = 0; j < pieces; ++j) {
    const int64_t p0 = j * P, len = std::min(P, n - p0);
    const bool from_before = p0 > 0 && keys[p0 - 1] == keys[p0];
    const bool into_next = p0 + len < n && keys[p0 + len] == keys[p0 + len - 1];
    for (int64_t e = 0; e < d; ++e)
      quant::fn::walk_piece(keys.data() + p0, rows.data() + p0, len, from_before, into_next, x, d,
                            e, k, [&](quant::fn::PiecePart part, int32_t c, T acc) {
                              if (part == quant::fn::PiecePart::head) head[j * d + e] = acc;
                              if (part == quant::fn::PiecePart::tail) tail[j * d + e] = acc;
                              if (part == quant::fn::PiecePart::whole) {
                                sums[c * d + e] = acc;
                                ++writes[c * d + e];
                              }
                            });
  }
  counts.assign(static_cast<size_t>(k), T(0));
  for (int64_t c = 0; c < k; ++c) {
    const int64_t s = std::lower_bound(keys.begin(), keys.end(), c) - keys.begin();
    const int64_t end = std::lower_bound(keys.begin(), keys.end(), c + 1) - keys.begin();
    counts[c] = static_cast<T>(end - s);
    for (int64_t e = 0; e < d; ++e) {
      if (s == end) {
        sums[c * d + e] = T(0);
        ++writes[c * d + e];
      } else if (quant::fn::spans_pieces(s, end, P)) {
        sums[c * d + e] = quant::fn::combine_code(s, end, P, head.data(), tail.data(), d, e);
        ++writes[c * d + e];
      }
    }
  }
}

}  // namespace

TEST_CASE("quant functors: code_statistics' piece walk gives every code's count and sum once") {
  struct Case {
    int64_t n, k, d, P;
  };
  for (Case c : {Case{1, 1, 1, 32}, Case{5, 3, 2, 32}, Case{1000, 16, 3, 32}, Case{1000, 16, 3, 4},
                 Case{3136, 512, 4, 64}, Case{5000, 8, 2, 32}, Case{5000, 8, 2, 1},
                 Case{4000, 9, 3, 7}, Case{777, 40, 5, 16}}) {
    // 0: random codes, some outside [0, k); 1: every row on one code; 2: a few codes
    for (int pattern : {0, 1, 2}) {
      INFO("n ", c.n, " k ", c.k, " d ", c.d, " P ", c.P, " pattern ", pattern);
      std::vector<int64_t> idx(static_cast<size_t>(c.n));
      std::mt19937_64 rng(static_cast<uint64_t>(c.n * 7 + c.P + pattern));
      for (auto& v : idx) {
        v = pattern == 1   ? 3 % c.k
            : pattern == 2 ? int64_t(rng() % 3) * (c.k / 3)
                           : int64_t(rng() % static_cast<uint64_t>(c.k + 1)) - (rng() % 50 == 0);
      }
      const Tensor x = random_tensor({c.n, c.d}, DType::f64, 41);
      std::vector<double> counts, sums;
      std::vector<int> writes;
      pieces_on_cpu(idx, x.data<double>(), c.k, c.d, c.P, counts, sums, writes);
      CHECK(std::all_of(writes.begin(), writes.end(), [](int w) { return w == 1; }));
      // Against the CPU entry (which counts an index outside [0, k) nowhere, as the walk does).
      Tensor want_counts = empty({c.k}, {.dtype = DType::f64});
      Tensor want_sums = empty({c.k, c.d}, {.dtype = DType::f64});
      cpu_t().code_statistics(DType::f64, idx.data(), x.raw_data(), c.n, c.k, c.d,
                              want_counts.raw_data(), want_sums.raw_data());
      CHECK(counts == want_counts.to_vector<double>());
      CHECK(max_err(from_vector<double>(sums, {c.k, c.d}), want_sums) <= 1e-12);
      // One piece holds everything: the CPU's order, bit for bit.
      pieces_on_cpu(idx, x.data<double>(), c.k, c.d, c.n, counts, sums, writes);
      CHECK(sums == want_sums.to_vector<double>());
    }
  }
}

TEST_CASE("quant cuda: code_statistics counts exactly, sums within rounding, same bits every run") {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t n, k, d;
    int pattern;  // 0: random codes, 1: every row on code 3, 2: a few codes, long runs
  };
  for (Case c : {Case{0, 5, 4, 0}, Case{1, 1, 1, 0}, Case{1000, 16, 8, 0}, Case{3136, 512, 64, 0},
                 Case{70000, 1024, 33, 0}, Case{70000, 8, 300, 1}, Case{20000, 4096, 16, 2}}) {
    INFO("n ", c.n, " k ", c.k, " d ", c.d, " pattern ", c.pattern);
    std::vector<int64_t> iv(static_cast<size_t>(c.n));
    std::mt19937_64 rng(static_cast<uint64_t>(c.n + c.k));
    for (size_t i = 0; i < iv.size(); ++i)
      iv[i] = c.pattern == 1   ? 3
              : c.pattern == 2 ? int64_t(rng() % 3) * 1000
                               : int64_t(rng() % static_cast<uint64_t>(c.k));
    const Tensor idx = from_vector<int64_t>(iv, {c.n});
    for (DType dt : {DType::f32, DType::f64}) {
      const Tensor x = random_tensor({c.n, c.d}, dt, 31);
      Tensor counts = empty({c.k}, {.dtype = dt}), sums = empty({c.k, c.d}, {.dtype = dt});
      cpu_t().code_statistics(dt, idx.data<int64_t>(), x.raw_data(), c.n, c.k, c.d,
                              counts.raw_data(), sums.raw_data());
      const Tensor gidx = on_gpu(idx), gx = on_gpu(x);
      Tensor bytes[2][2];
      for (auto& run : bytes) {
        run[0] = empty({c.k}, {.dtype = dt, .device = Device::cuda(0)});
        run[1] = empty({c.k, c.d}, {.dtype = dt, .device = Device::cuda(0)});
        gpu_t().code_statistics(dt, static_cast<const int64_t*>(gidx.raw_data()), gx.raw_data(),
                                c.n, c.k, c.d, run[0].raw_data(), run[1].raw_data());
      }
      CHECK(same_bytes(bytes[0][0], counts));  // whole numbers: exact
      CHECK(max_err(bytes[0][1], sums) <= 10 * tol(dt));
      CHECK(same_bytes(bytes[1][0], bytes[0][0]));  // deterministic
      CHECK(same_bytes(bytes[1][1], bytes[0][1]));
    }
  }
  // An index outside [0, k) counts nowhere.
  const Tensor idx = on_gpu(from_vector<int64_t>({0, -1, 2, 7, 2}, {5}));
  const Tensor x = on_gpu(from_vector<float>({1, 2, 3, 4, 5}, {5, 1}));
  Tensor counts = empty({3}, {.device = Device::cuda(0)}),
         sums = empty({3, 1}, {.device = Device::cuda(0)});
  gpu_t().code_statistics(DType::f32, static_cast<const int64_t*>(idx.raw_data()), x.raw_data(), 5,
                          3, 1, counts.raw_data(), sums.raw_data());
  CHECK(counts.to(Device::cpu()).to_vector<float>() == std::vector<float>{1, 0, 2});
  CHECK(sums.to(Device::cpu()).to_vector<float>() == std::vector<float>{1, 0, 8});
}

TEST_CASE("quant cuda: LFQ bit products, their gradient and the clamped entropy") {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t k : {0, 1, 5, 9}) {
      const int64_t rows = 6, n = int64_t(1) << k;
      Generator gen(14);
      Tensor pi = rand({rows, k, 2}, gen).to(dt);
      Tensor go = random_tensor({rows, n}, dt, 15);
      Tensor want = empty({rows, n}, {.dtype = dt});
      Tensor got = empty({rows, n}, {.dtype = dt, .device = Device::cuda(0)});
      cpu_t().bit_product(dt, pi.raw_data(), rows, k, want.raw_data());
      gpu_t().bit_product(dt, on_gpu(pi).raw_data(), rows, k, got.raw_data());
      INFO(dtype_name(dt), " k ", k);
      CHECK(same_bytes(got, want));  // the same multiplications in the same order
      Tensor gwant = zeros({rows, k, 2}, {.dtype = dt});
      Tensor ggot = zeros({rows, k, 2}, {.dtype = dt, .device = Device::cuda(0)});
      cpu_t().bit_product_grad(dt, pi.raw_data(), go.raw_data(), rows, k, gwant.raw_data());
      gpu_t().bit_product_grad(dt, on_gpu(pi).raw_data(), on_gpu(go).raw_data(), rows, k,
                               ggot.raw_data());
      CHECK(max_err(ggot, gwant) <= tol(dt));
    }
  // The entropy walk: a thread per token up to kEntropyWalkMaxBits (the
  // device's exp and log1p, within a few ulps of glibc's), staged through
  // the CPU entry beyond (the same bits). Near-uniform tokens (scale 0.05)
  // walk 2^d codes; confident ones (scale 3) a handful.
  for (int64_t d : {int64_t{1}, int64_t{12}, int64_t{16}, quant_cuda::kEntropyWalkMaxBits,
                    quant_cuda::kEntropyWalkMaxBits + 1})
    for (double scale : {0.05, 3.0}) {
      INFO("d ", d, " scale ", scale);
      const int64_t rows = d > 12 && scale < 1 ? 3 : 37;
      Tensor z = random_tensor({rows, d}, DType::f64, 16) * scale;
      Tensor h = empty({rows}, {.dtype = DType::f64}), g = empty({rows, d}, {.dtype = DType::f64});
      Tensor gh = empty({rows}, {.dtype = DType::f64, .device = Device::cuda(0)});
      Tensor gg = empty({rows, d}, {.dtype = DType::f64, .device = Device::cuda(0)});
      cpu_t().clamped_entropy(z.data<double>(), rows, d, h.data<double>(), g.data<double>());
      gpu_t().clamped_entropy(testing::dev<double>(on_gpu(z)), rows, d, testing::dev<double>(gh),
                              testing::dev<double>(gg));
      if (d > quant_cuda::kEntropyWalkMaxBits) {
        CHECK(same_bytes(gh, h));
        CHECK(same_bytes(gg, g));
      } else {
        CHECK(max_err(gh, h) <= 1e-12);
        CHECK(max_err(gg, g) <= 1e-10);
      }
    }
}

TEST_CASE("quant cuda: NF4 absmax, codes and values are the CPU's bytes") {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1000;  // partial last block and run
  Tensor x = random_tensor({n}, DType::f32, 17) * 4.0;
  x.data<float>()[70] = std::nanf("");
  x.data<float>()[300] = 0;
  Tensor gx = on_gpu(x);
  for (int64_t block : {32, 64, 128, 256}) {
    INFO("block ", block);
    const int64_t blocks = (n + block - 1) / block, run = std::min<int64_t>(block, 64);
    Tensor absmax = empty({blocks});
    Tensor gabs = empty({blocks}, {.device = Device::cuda(0)});
    cpu_t().nf4_absmax(x.data<float>(), n, block, absmax.data<float>());
    gpu_t().nf4_absmax(testing::dev<float>(gx), n, block, testing::dev<float>(gabs));
    REQUIRE(same_bytes(gabs, absmax));
    // bitsandbytes' layout: packed codes, scales apart.
    Tensor packed = zeros({(n + 1) / 2}, {.dtype = DType::u8});
    Tensor gpacked = zeros({(n + 1) / 2}, {.dtype = DType::u8, .device = Device::cuda(0)});
    cpu_t().nf4_encode(
        x.data<float>(), n, block, absmax.data<float>(), absmax.data<float>(),
        {.run = run, .codes = packed.data<uint8_t>(), .code_stride = run / 2, .pad_runs = false});
    gpu_t().nf4_encode(testing::dev<float>(gx), n, block, testing::dev<float>(gabs),
                       testing::dev<float>(gabs),
                       {.run = run,
                        .codes = testing::dev<uint8_t>(gpacked),
                        .code_stride = run / 2,
                        .pad_runs = false});
    CHECK(same_bytes(gpacked, packed));
    const NF4Runs w = nf4_packed_runs(packed.data<uint8_t>(), absmax.data<float>(), n, block);
    const NF4Runs gw =
        nf4_packed_runs(testing::dev<uint8_t>(gpacked), testing::dev<float>(gabs), n, block);
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      Tensor want = empty({n}, {.dtype = dt});
      Tensor got = empty({n}, {.dtype = dt, .device = Device::cuda(0)});
      cpu_t().nf4_decode(w, dt, want.raw_data());
      gpu_t().nf4_decode(gw, dt, got.raw_data());
      CHECK(same_bytes(got, want));
    }
  }
  // The nf4 dtype's units: padded runs, scales inside.
  const Tensor units = cpu_units(x);
  const int64_t runs = (n + 63) / 64;
  Tensor gabs = empty({runs}, {.device = Device::cuda(0)});
  Tensor gunits = zeros({units.numel()}, {.dtype = DType::u8, .device = Device::cuda(0)});
  gpu_t().nf4_absmax(testing::dev<float>(gx), n, 64, testing::dev<float>(gabs));
  gpu_t().nf4_encode(testing::dev<float>(gx), n, 64, testing::dev<float>(gabs),
                     testing::dev<float>(gabs),
                     {.run = 64,
                      .codes = testing::dev<uint8_t>(gunits),
                      .code_stride = static_cast<int64_t>(kNF4UnitBytes),
                      .pad_runs = true,
                      .scales = testing::dev<uint8_t>(gunits) + kNF4CodeBytes,
                      .scale_stride = static_cast<int64_t>(kNF4UnitBytes)});
  CHECK(same_bytes(gunits, units));
}

TEST_CASE("quant cuda: nf4_decode by words and by elements writes the CPU's values") {
  SKIP_WITHOUT_GPU();
  // Sizes with and without a partial last word and run; outputs on and off
  // 16 bytes (the second takes the element kernel for everything).
  for (int64_t n : {int64_t{8}, int64_t{64}, int64_t{1001}, int64_t{4096 + 68}}) {
    const Tensor units = cpu_units(random_tensor({n}, DType::f32, 23));
    const Tensor gunits = on_gpu(units);
    const NF4Runs w = nf4_unit_runs(units.data<uint8_t>(), n);
    const NF4Runs gw = nf4_unit_runs(testing::dev<uint8_t>(gunits), n);
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (int64_t shift : {0, 1}) {
        INFO("n ", n, " ", dtype_name(dt), " output shifted by ", shift);
        Tensor want = empty({n}, {.dtype = dt});
        Tensor got = empty({n + shift}, {.dtype = dt, .device = Device::cuda(0)});
        cpu_t().nf4_decode(w, dt, want.raw_data());
        gpu_t().nf4_decode(gw, dt, got.narrow(0, shift, n).raw_data());
        CHECK(same_bytes(got.narrow(0, shift, n), want));
      }
  }
}

TEST_CASE("quant cuda: nf4_linear and its gradient equal the CPU's within rounding") {
  SKIP_WITHOUT_GPU();
  struct Shape3 {
    int64_t m, k, n;
  };
  // Small batches (the CPU's fused path), a K that is not whole runs, and
  // enough weight rows for two GPU tiles.
  for (Shape3 s :
       {Shape3{1, 128, 70}, Shape3{5, 100, 33}, Shape3{40, 256, 9}, Shape3{3, 4096, 1100}}) {
    const Tensor wf = random_tensor({s.n * s.k}, DType::f32, 18);
    const Tensor units = cpu_units(wf);
    const Tensor gunits = on_gpu(units);
    const NF4Runs w = nf4_unit_runs(units.data<uint8_t>(), s.n * s.k);
    const NF4Runs gw = nf4_unit_runs(testing::dev<uint8_t>(gunits), s.n * s.k);
    for (DType dt : {DType::f32, DType::f64})
      for (DType dd : {DType::f32, DType::bf16, DType::f16}) {
        INFO(s.m, "x", s.k, "x", s.n, " ", dtype_name(dt), " dequant ", dtype_name(dd));
        Tensor x = random_tensor({s.m, s.k}, dt, 19), bias = random_tensor({s.n}, dt, 20);
        Tensor want = empty({s.m, s.n}, {.dtype = dt});
        Tensor got = empty({s.m, s.n}, {.dtype = dt, .device = Device::cuda(0)});
        cpu_t().nf4_linear(dt, x.raw_data(), s.m, s.k, w, dd, s.n, bias.raw_data(),
                           want.raw_data());
        gpu_t().nf4_linear(dt, on_gpu(x).raw_data(), s.m, s.k, gw, dd, s.n, on_gpu(bias).raw_data(),
                           got.raw_data());
        CHECK(max_err(got, want) <= 10 * tol(dt));
        Tensor g = random_tensor({s.m, s.n}, dt, 21);
        Tensor dwant = empty({s.m, s.k}, {.dtype = dt});
        Tensor dgot = empty({s.m, s.k}, {.dtype = dt, .device = Device::cuda(0)});
        cpu_t().nf4_linear_grad(dt, g.raw_data(), s.m, s.n, w, dd, s.k, dwant.raw_data());
        gpu_t().nf4_linear_grad(dt, on_gpu(g).raw_data(), s.m, s.n, gw, dd, s.k, dgot.raw_data());
        CHECK(max_err(dgot, dwant) <= 10 * tol(dt));
      }
  }
}

// The fused GEMV (m <= kNF4GemvMaxBatch, rows of whole runs) against the CPU
// and against the GPU's own tiled path: the same x with one more row goes
// through dequantized tiles and cuBLAS, and its first m rows must agree.
TEST_CASE("quant cuda: the NF4 GEMV equals the CPU and the tiled path within rounding") {
  SKIP_WITHOUT_GPU();
  using quant_cuda::kNF4GemvMaxBatch;
  struct Case {
    int64_t m, k, n, block;  // block 64 with units: the nf4 dtype; else bitsandbytes' layout
    bool units;
  };
  // k: one run, runs that end mid-step (320 = 1.25 steps), several passes of
  // staged x (8192); n: not a multiple of a block's 16 rows, 1, many blocks.
  const Case cases[] = {{1, 64, 1, 64, true},
                        {1, 320, 17, 64, true},
                        {2, 8192, 33, 64, true},
                        {3, 4096, 1100, 64, true},
                        {8, 320, 70, 64, true},
                        {5, 96, 9, 32, false},
                        {4, 512, 40, 128, false},
                        {7, 768, 19, 256, false},
                        {kNF4GemvMaxBatch, 1024, 257, 64, false}};
  for (const Case& c : cases) {
    const Tensor wf = random_tensor({c.n * c.k}, DType::f32, 31);
    // The CPU's codes and scales in the case's layout, copied to the GPU.
    Tensor codes, scales;
    if (c.units) {
      codes = cpu_units(wf);
    } else {
      const int64_t n = c.n * c.k, run = std::min<int64_t>(c.block, 64);
      scales = empty({(n + c.block - 1) / c.block});
      codes = zeros({(n + 1) / 2}, {.dtype = DType::u8});
      cpu_t().nf4_absmax(wf.data<float>(), n, c.block, scales.data<float>());
      cpu_t().nf4_encode(
          wf.data<float>(), n, c.block, scales.data<float>(), scales.data<float>(),
          {.run = run, .codes = codes.data<uint8_t>(), .code_stride = run / 2, .pad_runs = false});
    }
    const Tensor gcodes = on_gpu(codes), gscales = scales.defined() ? on_gpu(scales) : Tensor();
    auto runs = [&](const Tensor& cs, const Tensor& ss) {
      const auto* b = testing::dev<uint8_t>(cs);
      return c.units ? nf4_unit_runs(b, c.n * c.k)
                     : nf4_packed_runs(b, testing::dev<float>(ss), c.n * c.k, c.block);
    };
    const NF4Runs w = runs(codes, scales), gw = runs(gcodes, gscales);
    REQUIRE(quant_cuda::nf4_use_gemv(c.m, c.k, c.n, gw));
    REQUIRE_FALSE(quant_cuda::nf4_use_gemv(kNF4GemvMaxBatch + 1, c.k, c.n, gw));
    for (DType dt : {DType::f32, DType::f64})
      for (DType dd : {DType::f32, DType::bf16, DType::f16})
        for (bool with_bias : {false, true}) {
          INFO(c.m, "x", c.k, "x", c.n, " block ", c.block, c.units ? " units " : " packed ",
               dtype_name(dt), " dequant ", dtype_name(dd), with_bias ? " bias" : "");
          const int64_t mt = kNF4GemvMaxBatch + 1;  // rows for the tiled path
          const Tensor xt = random_tensor({mt, c.k}, dt, 32);
          const Tensor x = slice(xt, 0, 0, c.m).contiguous();
          const Tensor bias = with_bias ? random_tensor({c.n}, dt, 33) : Tensor();
          const Tensor gbias = with_bias ? on_gpu(bias) : Tensor();
          const void* b = with_bias ? bias.raw_data() : nullptr;
          const void* gb = with_bias ? gbias.raw_data() : nullptr;
          Tensor want = empty({c.m, c.n}, {.dtype = dt});
          Tensor got = empty({c.m, c.n}, {.dtype = dt, .device = Device::cuda(0)});
          Tensor tiled = empty({mt, c.n}, {.dtype = dt, .device = Device::cuda(0)});
          cpu_t().nf4_linear(dt, x.raw_data(), c.m, c.k, w, dd, c.n, b, want.raw_data());
          gpu_t().nf4_linear(dt, on_gpu(x).raw_data(), c.m, c.k, gw, dd, c.n, gb, got.raw_data());
          gpu_t().nf4_linear(dt, on_gpu(xt).raw_data(), mt, c.k, gw, dd, c.n, gb, tiled.raw_data());
          CHECK(max_err(got, want) <= 10 * tol(dt));
          CHECK(max_err(got, slice(tiled.to(Device::cpu()), 0, 0, c.m)) <= 10 * tol(dt));
        }
  }
}

// Through the op: nf4 tensors (double quant on and off) and bitsandbytes
// states (block 32 and 128, double quant on and off) on the GPU, small
// batches and one over the threshold, against the same op on the CPU.
TEST_CASE("quant cuda: nf4_linear on small batches equals the CPU, double quant on and off") {
  SKIP_WITHOUT_GPU();
  const int64_t n_out = 45, n_in = 256;
  const Tensor wf = random_tensor({n_out, n_in}, DType::f32, 41);
  const Tensor bias = random_tensor({n_out}, DType::f32, 42);
  for (bool dq : {false, true})
    for (int64_t block : {32, 64, 128}) {
      NF4Options o;
      o.block_size = block;
      o.double_quant = dq;
      const BnbNF4State state = quantize_bnb(wf, o);  // nf4_linear moves it to x's device
      const Tensor q = block == 64 ? quantize_nf4(wf, o) : Tensor();
      for (int64_t m : {1, 3, 8, 9}) {
        INFO("block ", block, dq ? " double quant" : "", " m ", m);
        const Tensor x = random_tensor({m, n_in}, DType::f32, 43);
        const Tensor want = nf4_linear(x, state, bias);
        CHECK(max_err(nf4_linear(on_gpu(x), state, on_gpu(bias)), want) <= 10 * tol(DType::f32));
        if (q.defined()) {
          const Tensor want_q = nf4_linear(x, q, bias);
          CHECK(max_err(nf4_linear(on_gpu(x), on_gpu(q), on_gpu(bias)), want_q) <=
                10 * tol(DType::f32));
        }
      }
    }
}

TEST_CASE("quant cuda: zero sizes launch nothing") {
  SKIP_WITHOUT_GPU();
  const QuantKernelTable& t = gpu_t();
  Tensor sums = full({2}, 7.0, {.dtype = DType::f64, .device = Device::cuda(0)});
  t.squared_error(DType::f32, nullptr, nullptr, nullptr, 0, 4, testing::dev<double>(sums));
  CHECK(sums.to_vector<double>() == std::vector<double>{0.0, 0.0});  // zeros, still written
  t.nearest_codes(DType::f32, nullptr, nullptr, 0, 3, 4, false, nullptr);
  t.squared_error_grad(DType::f32, nullptr, nullptr, nullptr, 0, 4, testing::dev<double>(sums),
                       nullptr);
  t.route_grad(true, DType::f32, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4, nullptr);
  t.put_rows(DType::f32, nullptr, 4, nullptr, 0, nullptr, 1.0);
  t.bit_product(DType::f32, nullptr, 0, 3, nullptr);
  t.clamped_entropy(nullptr, 0, 3, nullptr, nullptr);
  t.nf4_decode(NF4Runs{}, DType::f32, nullptr);
  t.nf4_linear(DType::f32, nullptr, 0, 64, NF4Runs{}, DType::f32, 4, nullptr, nullptr);
  t.nf4_linear_grad(DType::f32, nullptr, 0, 4, NF4Runs{}, DType::f32, 64, nullptr);
}
