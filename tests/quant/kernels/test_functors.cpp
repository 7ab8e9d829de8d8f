// The math the CPU and CUDA quantizer kernels share (quant/kernels/):
// each functor against the rule it implements, and the CUDA kernels' own
// orders of work (lane scans, piece walks) replayed on the CPU against the
// CPU table, so their logic is covered where no GPU is.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "quant/kernels/code_stats_pieces.h"
#include "quant/kernels/entropy_walk.h"
#include "quant/kernels/functors.h"
#include "quant/kernels/table.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quanta.h"
#include "support/quant_table_checks.h"

using namespace quanta;
using namespace quanta::quant;
using namespace quanta::testing;
namespace qfn = quanta::quant::fn;

namespace {

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

// The CUDA kernel's scan: 32 lanes each offered every 32nd score of a tile
// (argmin_lane_scan, the kernel's own code), merged in a butterfly, then
// across two tiles. With a bias, each score is split into bias + rest.
int64_t lane_argmin(const std::vector<double>& row, size_t split, bool with_bias = false) {
  auto tile = [&](size_t lo, size_t hi) {
    std::vector<double> scores(row.begin() + static_cast<std::ptrdiff_t>(lo),
                               row.begin() + static_cast<std::ptrdiff_t>(hi));
    std::vector<double> bias(scores.size());
    if (with_bias)
      for (size_t j = 0; j < scores.size(); ++j) {
        bias[j] = std::isfinite(scores[j]) ? 0.25 * double(j % 5) : 0.0;
        scores[j] -= bias[j];  // exact for whole numbers; random rows' minimum stands apart
      }
    std::vector<qfn::ArgMin<double>> lanes(32);
    for (int64_t l = 0; l < 32; ++l)
      lanes[static_cast<size_t>(l)] = qfn::argmin_lane_scan(
          scores.data(), with_bias ? bias.data() : nullptr, static_cast<int64_t>(scores.size()),
          static_cast<int64_t>(lo), l, 32);
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
      for (bool with_bias : {false, true})
        CHECK(lane_argmin(row, split, with_bias) == rule_argmin(row));
  }
  // Long rows with repeated values: every lane and tile boundary, and lanes
  // whose share is a multiple of the loads read ahead and ones that is not.
  for (size_t n : {200, 256, 257, 1000}) {
    CAPTURE(n);
    std::vector<double> row(n);
    for (size_t j = 0; j < row.size(); ++j) row[j] = double((j * 37) % 11);
    row[150] = kNaN;
    for (size_t split : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{100}, n})
      for (bool with_bias : {false, true})
        CHECK(lane_argmin(row, split, with_bias) == rule_argmin(row));
  }
  // The smallest score in every lane's every position of a batch read ahead.
  for (size_t at = 0; at < 600; at += 7) {
    std::vector<double> row = random_values(600, 3);
    row[at] = -2;
    CHECK(lane_argmin(row, 300, true) == static_cast<int64_t>(at));
  }
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
  // The byte offsets of codes in a table of f32 values, over words that put
  // every code in every place.
  std::mt19937 rng(11);
  for (int t = 0; t < 200; ++t) {
    const uint32_t w =
        t < 16 ? 0x11111111u * static_cast<uint32_t>(t) : static_cast<uint32_t>(rng());
    const qfn::NF4WordOffsets both = qfn::nf4_word_offsets(w);
    for (int j = 0; j < 8; ++j) {
      const uint32_t four_of = j % 2 ? both.odd : both.even;
      CHECK(((four_of >> (8 * (j / 2))) & 0xffu) ==
            4u * static_cast<uint32_t>(qfn::nf4_word_code(w, j)));
    }
  }
  for (int c = 0; c < 16; ++c) CHECK(qfn::nf4_value(c) == kNF4Values[static_cast<size_t>(c)]);
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
      cpu_quant_table().code_statistics(DType::f64, idx.data(), x.raw_data(), c.n, c.k, c.d,
                                        want_counts.raw_data(), want_sums.raw_data());
      CHECK(counts == want_counts.to_vector<double>());
      CHECK(max_err(from_vector<double>(sums, {c.k, c.d}), want_sums) <= 1e-12);
      // One piece holds everything: the CPU's order, bit for bit.
      pieces_on_cpu(idx, x.data<double>(), c.k, c.d, c.n, counts, sums, writes);
      CHECK(sums == want_sums.to_vector<double>());
    }
  }
}
