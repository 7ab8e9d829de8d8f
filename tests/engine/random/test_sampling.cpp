// Samplers and dropout: the documented word -> value rules (replayed from a
// copy of the generator), distribution statistics on large fixed-seed draws,
// validation, zero-size inputs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "engine/cpu/block_cache.h"
#include "engine/kernels/table.h"
#include "engine/random/draw.h"
#include "quanta.h"
#include "support/gpu.h"
#include "support/relative_error.h"

using namespace quanta;
using quanta::testing::max_rel_diff;

namespace {

std::vector<uint32_t> words(Generator g, int64_t n) {  // a copy: replays the stream
  std::vector<uint32_t> w(static_cast<size_t>(n));
  g.fill_u32(w.data(), n);
  return w;
}

struct Stats {
  double mean, var;
};
Stats stats(const std::vector<double>& v) {
  double m = 0, q = 0;
  for (double x : v) m += x;
  m /= static_cast<double>(v.size());
  for (double x : v) q += (x - m) * (x - m);
  return {m, q / static_cast<double>(v.size())};
}

// Pearson chi-square of counts against equal expected counts.
double chi_square_uniform(const std::vector<int64_t>& counts) {
  double total = 0;
  for (auto c : counts) total += static_cast<double>(c);
  const double e = total / static_cast<double>(counts.size());
  double chi = 0;
  for (auto c : counts) chi += (static_cast<double>(c) - e) * (static_cast<double>(c) - e) / e;
  return chi;
}

}  // namespace

TEST_CASE("rand: f32 uses (w >> 8) * 2^-24, f64 uses 53 bits of two words") {
  Generator g(21);
  const auto w = words(g, 16);
  const auto f = rand({2, 3}, g, {}).to_vector<float>();
  for (size_t i = 0; i < 6; ++i) CHECK(f[i] == static_cast<float>(w[i] >> 8) * 0x1p-24f);
  CHECK(g.offset().lo == 2);

  Generator h(21);
  const auto d = rand({3}, h, {.dtype = DType::f64}).to_vector<double>();
  for (size_t i = 0; i < 3; ++i) {
    const uint64_t x = (static_cast<uint64_t>(w[2 * i + 1]) << 32) | w[2 * i];
    CHECK(d[i] == static_cast<double>(x >> 11) * 0x1p-53);
  }
  CHECK(h.offset().lo == 2);  // 6 words
}

TEST_CASE("rand: uniform [0,1) statistics on 1e6 samples, f32 and f64") {
  for (DType dt : {DType::f32, DType::f64}) {
    Generator g = Generator::named(1, "rand.stats");
    const auto v = rand({1000, 1000}, g, {.dtype = dt}).to_vector<double>();
    CHECK(*std::min_element(v.begin(), v.end()) >= 0.0);
    CHECK(*std::max_element(v.begin(), v.end()) < 1.0);
    const Stats s = stats(v);
    CHECK(std::abs(s.mean - 0.5) < 2e-3);        // sd of the mean ~2.9e-4
    CHECK(std::abs(s.var - 1.0 / 12.0) < 5e-4);  // sd of the variance ~7.5e-5
  }
}

TEST_CASE("rand: 16-bit floats stay in [0,1) on their own grid") {
  Generator g(4);
  const auto b = rand({4096}, g, {.dtype = DType::bf16});
  CHECK(b.dtype() == DType::bf16);
  const auto bv = b.to_vector<double>();
  for (double x : bv) {
    CHECK(x >= 0.0);
    CHECK(x < 1.0);
    CHECK(x * 256 == std::floor(x * 256));
  }
  const auto h = rand({4096}, g, {.dtype = DType::f16}).to_vector<double>();
  CHECK(*std::max_element(h.begin(), h.end()) < 1.0);
  CHECK(stats(h).mean == doctest::Approx(0.5).epsilon(0.05));
}

TEST_CASE("rand/randn: reproducible from (key, offset), options honoured") {
  Generator a(77), b(77);
  CHECK(rand({5, 7}, a).to_vector<float>() == rand({5, 7}, b).to_vector<float>());
  CHECK(randn({9}, a).to_vector<float>() == randn({9}, b).to_vector<float>());
  CHECK(rand({3}, a).to_vector<float>() != rand({3}, a).to_vector<float>());
  const Tensor r = rand({3}, a, {.dtype = DType::f64, .requires_grad = true});
  CHECK(r.requires_grad());
  CHECK(r.dtype() == DType::f64);
  CHECK_THROWS_AS(rand({2}, a, {.dtype = DType::i64}), std::invalid_argument);
  CHECK_THROWS_AS(randn({2}, a, {.dtype = DType::i32}), std::invalid_argument);
  CHECK_THROWS_AS(rand({-1, 2}, a), std::invalid_argument);
}

TEST_CASE("randn: Box-Muller on pairs, words as documented") {
  Generator g(8);
  const auto w = words(g, 8);
  const auto z = randn({3}, g).to_vector<float>();
  CHECK(g.offset().lo == 1);  // 2 pairs * 2 words
  for (int j = 0; j < 2; ++j) {
    const double u1 = (static_cast<double>(w[2 * j]) + 1.0) / 4294967296.0;
    const double u2 = static_cast<double>(w[2 * j + 1]) / 4294967296.0;
    const double r = std::sqrt(-2.0 * std::log(u1)), t = 6.283185307179586 * u2;
    CHECK(z[2 * j] == static_cast<float>(r * std::cos(t)));
    if (2 * j + 1 < 3) CHECK(z[2 * j + 1] == static_cast<float>(r * std::sin(t)));
  }
  // An odd count is the even count's prefix.
  Generator h(8);
  const auto z4 = randn({4}, h).to_vector<float>();
  CHECK(std::vector<float>(z4.begin(), z4.begin() + 3) == z);

  Generator d(8);
  const auto zd = randn({2}, d, {.dtype = DType::f64}).to_vector<double>();
  CHECK(d.offset().lo == 1);  // one pair = four words = one block
  auto x53 = [&](int a) {
    return static_cast<double>(((static_cast<uint64_t>(w[a + 1]) << 32) | w[a]) >> 11);
  };
  const double u1 = (x53(0) + 1) * 0x1p-53, u2 = x53(2) * 0x1p-53;
  CHECK(zd[0] == std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  CHECK(zd[1] == std::sqrt(-2.0 * std::log(u1)) * std::sin(6.283185307179586 * u2));
}

TEST_CASE("randn: mean 0, std 1 on 1e6 samples") {
  for (DType dt : {DType::f32, DType::f64}) {
    Generator g = Generator::named(2, "randn.stats");
    const auto v = randn({1000000}, g, {.dtype = dt}).to_vector<double>();
    const Stats s = stats(v);
    CHECK(std::abs(s.mean) < 5e-3);
    CHECK(std::abs(std::sqrt(s.var) - 1.0) < 5e-3);
    // Tails: P(|z| > 2) = 0.0455.
    const auto tail = std::count_if(v.begin(), v.end(), [](double x) { return std::abs(x) > 2; });
    CHECK(static_cast<double>(tail) / 1e6 == doctest::Approx(0.0455).epsilon(0.03));
  }
  Generator g(3);
  const Tensor b = randn({100}, g, {.dtype = DType::bf16});
  CHECK(b.dtype() == DType::bf16);
  CHECK(b.shape() == Shape{100});
}

TEST_CASE("randint: range, multiply-shift rule, chi-square uniformity") {
  Generator g(31);
  const auto w = words(g, 8);
  const auto first = randint(-3, 7, {4}, g).to_vector<int64_t>();
  for (size_t i = 0; i < 4; ++i) {
    const uint64_t x = (static_cast<uint64_t>(w[2 * i + 1]) << 32) | w[2 * i];
    const auto expect = static_cast<int64_t>((static_cast<unsigned __int128>(x) * 10) >> 64) - 3;
    CHECK(first[i] == expect);
  }
  const Tensor t = randint(-3, 7, {100000}, g);
  CHECK(t.dtype() == DType::i64);
  std::vector<int64_t> counts(10, 0);
  for (int64_t v : t.to_vector<int64_t>()) {
    REQUIRE(v >= -3);
    REQUIRE(v < 7);
    ++counts[static_cast<size_t>(v + 3)];
  }
  CHECK(chi_square_uniform(counts) < 27.9);  // df 9, p = 0.001

  const auto one = randint(5, 6, {50}, g).to_vector<int64_t>();
  CHECK(std::all_of(one.begin(), one.end(), [](int64_t v) { return v == 5; }));
  const auto wide =
      randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {1000}, g)
          .to_vector<int64_t>();
  CHECK(std::count_if(wide.begin(), wide.end(), [](int64_t v) { return v < 0; }) > 400);
  CHECK(std::count_if(wide.begin(), wide.end(), [](int64_t v) { return v > 0; }) > 400);

  const Tensor small = randint(0, 256, {64}, g, {.dtype = DType::u8});
  CHECK(small.dtype() == DType::u8);
  CHECK(randint(-5, 5, {8}, g, {.dtype = DType::i32}).dtype() == DType::i32);
  CHECK(randint(0, 4, {8}, g, {.dtype = DType::f32}).dtype() == DType::f32);

  const PhiloxOffset before = g.offset();
  CHECK_THROWS_AS(randint(3, 3, {2}, g), std::invalid_argument);
  CHECK_THROWS_AS(randint(0, 257, {2}, g, {.dtype = DType::u8}), std::invalid_argument);
  CHECK_THROWS_AS(randint(-1, 2, {2}, g, {.dtype = DType::u8}), std::invalid_argument);
  CHECK_THROWS_AS(randint(0, 2, {2}, g, {.dtype = DType::boolean}), std::invalid_argument);
  CHECK(g.offset() == before);  // failed calls draw nothing
}

TEST_CASE("randperm: a permutation, uniform over orders") {
  Generator g(12);
  const auto p = randperm(1000, g).to_vector<int64_t>();
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) CHECK(sorted[static_cast<size_t>(i)] == i);
  std::vector<int64_t> identity(1000);
  for (int64_t i = 0; i < 1000; ++i) identity[static_cast<size_t>(i)] = i;
  CHECK(p != identity);

  Generator a(12);
  CHECK(randperm(1000, a).to_vector<int64_t>() == p);
  CHECK(randperm(0, g).shape() == Shape{0});
  CHECK(randperm(1, g).to_vector<int64_t>() == std::vector<int64_t>{0});
  CHECK_THROWS_AS(randperm(-1, g), std::invalid_argument);

  std::map<std::vector<int64_t>, int64_t> seen;
  for (int k = 0; k < 6000; ++k) ++seen[randperm(3, g).to_vector<int64_t>()];
  REQUIRE(seen.size() == 6);
  std::vector<int64_t> counts;
  for (auto& [perm, c] : seen) counts.push_back(c);
  CHECK(chi_square_uniform(counts) < 20.5);  // df 5, p = 0.001
}

TEST_CASE("randperm_prefix: randperm's first m entries, bitwise, and the same draws") {
  for (const int64_t m : {int64_t(0), int64_t(1), int64_t(37), int64_t(999), int64_t(1000)}) {
    Generator a(21), b(21);
    const auto full = randperm(1000, a).to_vector<int64_t>();
    CHECK(randperm_prefix(1000, m, b).to_vector<int64_t>() ==
          std::vector<int64_t>(full.begin(), full.begin() + m));
    CHECK(a.offset() == b.offset());  // the next draws agree too
  }
  Generator g(3);
  CHECK(randperm_prefix(5, 2, g, {.dtype = DType::f32}).dtype() == DType::f32);
  CHECK_THROWS_WITH_AS(randperm_prefix(5, 6, g), doctest::Contains("m must lie in [0, n = 5]"),
                       std::invalid_argument);
  CHECK_THROWS_AS(randperm_prefix(5, -1, g), std::invalid_argument);
}

// On sim, and on cuda:0 where a GPU is visible.
TEST_CASE("randperm on a device: the CPU's permutations, drawn and sorted there") {
  for (const Device device : quanta::testing::test_devices()) {
    CAPTURE(device.str());
    // The table's stable sort reads keys as unsigned; equal keys keep their order.
    const std::vector<int64_t> keys = {5, -1, 5, 0, std::numeric_limits<int64_t>::min(), 5};
    const Tensor k = from_vector<int64_t>(keys).to(device),
                 v = from_vector<int64_t>({10, 11, 12, 13, 14, 15}).to(device);
    for (const Device on : {Device::cpu(), device}) {
      const Tensor kk = k.to(on), vv = v.to(on);
      Tensor out = empty({6}, {.dtype = DType::i64, .device = on});
      kernels(on).sort_pairs(6, static_cast<const int64_t*>(kk.raw_data()),
                             static_cast<const int64_t*>(vv.raw_data()),
                             static_cast<int64_t*>(out.raw_data()));
      CHECK(out.to(Device::cpu()).to_vector<int64_t>() ==
            std::vector<int64_t>{13, 10, 12, 15, 14, 11});
    }
    for (const int64_t n : {int64_t(0), int64_t(1), int64_t(2), int64_t(1000), int64_t(70001)})
      for (const int64_t m : {int64_t(0), n / 3, n}) {
        CAPTURE(n);
        CAPTURE(m);
        Generator a(21), b(21);
        const Tensor d = randperm_prefix(n, m, b, {.dtype = DType::i64, .device = device});
        CHECK(d.device() == device);
        CHECK(d.to(Device::cpu()).to_vector<int64_t>() ==
              randperm_prefix(n, m, a).to_vector<int64_t>());
        CHECK(a.offset() == b.offset());  // the next draws agree too
      }
    Generator a(4), b(4);
    CHECK(randperm(300, b, {.dtype = DType::f32, .device = device})
              .to(Device::cpu())
              .to_vector<float>() == randperm(300, a, {.dtype = DType::f32}).to_vector<float>());
    // Drawn on the device, from a layer's stream, it replays in a captured
    // step, each replay the next permutation.
    Generator layer(9), host(9);
    layer.set_replayable();
    Tensor p;
    DeviceGraph g = DeviceGraph::capture(device, [&] {
      p = randperm_prefix(500, 20, layer, {.dtype = DType::i64, .device = device});
    });
    for (int s = 0; s < 3; ++s) {
      g.replay();
      CHECK(p.to(Device::cpu()).to_vector<int64_t>() ==
            randperm_prefix(500, 20, host).to_vector<int64_t>());
    }
  }
}

TEST_CASE("multinomial without replacement: no repeats, frequencies follow weights") {
  Generator g(13);
  const Tensor w = from_vector<float>({1, 2, 3, 4, 0});
  for (int k = 0; k < 200; ++k) {
    const auto s = multinomial(w, 4, false, g).to_vector<int64_t>();
    CHECK(std::set<int64_t>(s.begin(), s.end()).size() == 4);
    CHECK(std::find(s.begin(), s.end(), 4) == s.end());
  }
  // The first draw of each row follows the weights.
  const Tensor rows = from_vector<double>({1, 2, 3, 4, 0, 5, 0, 5, 0, 0}, {2, 5});
  std::vector<double> first0(5, 0), first1(5, 0);
  const int trials = 20000;
  for (int k = 0; k < trials; ++k) {
    const Tensor s = multinomial(rows, 2, false, g);
    CHECK(s.shape() == Shape{2, 2});
    const auto v = s.to_vector<int64_t>();
    CHECK(v[0] != v[1]);
    CHECK(v[2] != v[3]);
    first0[static_cast<size_t>(v[0])] += 1.0 / trials;
    first1[static_cast<size_t>(v[2])] += 1.0 / trials;
  }
  for (int j = 0; j < 5; ++j)
    CHECK(std::abs(first0[static_cast<size_t>(j)] - (j < 4 ? (j + 1) / 10.0 : 0.0)) < 0.015);
  CHECK(first1[0] == doctest::Approx(0.5).epsilon(0.04));
  CHECK(first1[2] == doctest::Approx(0.5).epsilon(0.04));
  CHECK(first1[1] + first1[3] + first1[4] == 0.0);
}

TEST_CASE("multinomial with replacement: frequencies follow weights") {
  Generator g(14);
  const Tensor w = from_vector<double>({0.1, 0, 0.6, 0.3});
  const auto s = multinomial(w, 100000, true, g).to_vector<int64_t>();
  std::vector<double> freq(4, 0);
  for (int64_t v : s) freq[static_cast<size_t>(v)] += 1e-5;
  CHECK(std::abs(freq[0] - 0.1) < 5e-3);
  CHECK(freq[1] == 0.0);
  CHECK(std::abs(freq[2] - 0.6) < 5e-3);
  CHECK(std::abs(freq[3] - 0.3) < 5e-3);
  // Weights need not be normalised; integer weights work.
  const auto t = multinomial(from_vector<int64_t>({0, 3, 0}), 50, true, g).to_vector<int64_t>();
  CHECK(std::all_of(t.begin(), t.end(), [](int64_t v) { return v == 1; }));
}

TEST_CASE("multinomial: validation and zero sizes") {
  Generator g(15);
  const PhiloxOffset before = g.offset();
  CHECK_THROWS_AS(multinomial(from_vector<float>({1, -1, 2}), 1, true, g), std::invalid_argument);
  CHECK_THROWS_AS(multinomial(from_vector<float>({1, NAN, 2}), 1, true, g), std::invalid_argument);
  CHECK_THROWS_AS(multinomial(from_vector<float>({1, INFINITY}), 1, true, g),
                  std::invalid_argument);
  CHECK_THROWS_AS(multinomial(from_vector<float>({1, 1, 0, 0}, {2, 2}), 1, true, g),
                  std::invalid_argument);  // row 1 all zero
  CHECK_THROWS_AS(multinomial(from_vector<float>({1, 1, 1}), 4, false, g), std::invalid_argument);
  CHECK_THROWS_AS(multinomial(from_vector<float>({1, 0, 1}), 3, false, g),
                  std::invalid_argument);  // only two positive weights
  CHECK_THROWS_AS(multinomial(ones({2, 2, 2}), 1, true, g), std::invalid_argument);
  CHECK_THROWS_AS(multinomial(ones({3}), -1, true, g), std::invalid_argument);
  CHECK(g.offset() == before);

  CHECK(multinomial(ones({0, 3}), 2, false, g).shape() == Shape{0, 2});
  CHECK(multinomial(ones({2, 3}), 0, true, g).shape() == Shape{2, 0});
  CHECK(multinomial(ones({3}), 3, false, g).dtype() == DType::i64);
  const auto all = multinomial(ones({3}), 3, false, g).to_vector<int64_t>();
  CHECK(std::set<int64_t>(all.begin(), all.end()) == std::set<int64_t>{0, 1, 2});
}

TEST_CASE("bernoulli: rate, word rule, dtypes") {
  Generator g(16);
  const auto w = words(g, 5);
  const auto b = bernoulli({5}, 0.4, g).to_vector<float>();
  for (size_t i = 0; i < 5; ++i) CHECK(b[i] == (w[i] / 4294967296.0 < 0.4 ? 1.0f : 0.0f));

  const auto v = bernoulli({1000000}, 0.3, g).to_vector<double>();
  CHECK(std::abs(stats(v).mean - 0.3) < 3e-3);
  const auto zeros_ = bernoulli({1000}, 0.0, g).to_vector<double>();
  CHECK(std::all_of(zeros_.begin(), zeros_.end(), [](double x) { return x == 0; }));
  const auto ones_ = bernoulli({1000}, 1.0, g).to_vector<double>();
  CHECK(std::all_of(ones_.begin(), ones_.end(), [](double x) { return x == 1; }));
  // p = 1 fused with a product (no 32-bit cut expresses it): every value kept.
  const Tensor x = rand({5000}, g);
  CHECK(bernoulli_mul(x, 1.0, 2.0, g).to_vector<float>() == (x * 2.0).to_vector<float>());
  CHECK(bernoulli_mul(x, 0.0, 2.0, g).to_vector<float>() == (x * 0.0).to_vector<float>());
  CHECK(bernoulli({4}, 0.5, g, {.dtype = DType::boolean}).dtype() == DType::boolean);
  CHECK(bernoulli({4}, 0.5, g, {.dtype = DType::bf16}).dtype() == DType::bf16);
  // Every dtype takes the same words and gives the same 0s and 1s.
  const Generator start = g;
  const std::vector<double> want =
      bernoulli({257}, 0.6, g, {.dtype = DType::f64}).to_vector<double>();
  for (DType t :
       {DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32, DType::u8, DType::boolean}) {
    CAPTURE(dtype_name(t));
    Generator replay = start;
    const Tensor got = bernoulli({257}, 0.6, replay, {.dtype = t});
    CHECK(got.dtype() == t);
    CHECK(got.to(DType::f64).to_vector<double>() == want);
    CHECK(replay.offset() == g.offset());
  }
  CHECK_THROWS_WITH_AS(bernoulli({2}, 0.5, g, {.dtype = DType::nf4}),
                       doctest::Contains("bernoulli"), std::invalid_argument);
  CHECK_THROWS_AS(bernoulli({2}, 1.5, g), std::invalid_argument);
  CHECK_THROWS_AS(bernoulli({2}, NAN, g), std::invalid_argument);
}

TEST_CASE("uniform_ / normal_: in place, any float dtype and layout") {
  Generator g(17);
  Tensor t = zeros({300, 400});
  Generator replay = g;
  uniform_(t, -2.0, 3.0, g);
  const auto v = t.to_vector<double>();
  CHECK(*std::min_element(v.begin(), v.end()) >= -2.0);
  CHECK(*std::max_element(v.begin(), v.end()) < 3.0);
  CHECK(std::abs(stats(v).mean - 0.5) < 0.02);
  const auto u = rand({300, 400}, replay).to_vector<float>();
  CHECK(v[123] == std::fma(5.0f, u[123], -2.0f));  // one rounding, on every device and build

  Tensor n = zeros({1000000}, {.dtype = DType::f64});
  normal_(n, 3.0, 2.0, g);
  const Stats s = stats(n.to_vector<double>());
  CHECK(std::abs(s.mean - 3.0) < 0.01);
  CHECK(std::abs(std::sqrt(s.var) - 2.0) < 0.01);

  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor h = zeros({64, 64}, {.dtype = dt});
    normal_(h, 0.0, 1.0, g);
    CHECK(h.dtype() == dt);
    CHECK(stats(h.to_vector<double>()).var > 0.8);
    uniform_(h, 0.0, 1.0, g);
    CHECK(stats(h.to_vector<double>()).mean == doctest::Approx(0.5).epsilon(0.05));
  }

  // A non-contiguous view is filled in place, and only where it points.
  Tensor base = zeros({6, 8});
  Tensor view = base.slice(1, 0, 8, 2).transpose(0, 1);
  uniform_(view, 1.0, 2.0, g);
  const auto bv = base.to_vector<float>();
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t c = 0; c < 8; ++c) {
      const float x = bv[static_cast<size_t>(r * 8 + c)];
      if (c % 2 == 0)
        CHECK((x >= 1.0f && x < 2.0f));
      else
        CHECK(x == 0.0f);
    }

  Tensor empty_t = zeros({0, 5});
  const PhiloxOffset before = g.offset();
  uniform_(empty_t, 0, 1, g);
  normal_(empty_t, 0, 1, g);
  CHECK(g.offset() == before);
}

TEST_CASE("uniform_ / normal_: refuse grad leaves under grad mode, bad arguments") {
  Generator g(18);
  Tensor w = zeros({4}).requires_grad_();
  CHECK_THROWS_AS(uniform_(w, 0, 1, g), std::invalid_argument);
  CHECK_THROWS_AS(normal_(w, 0, 1, g), std::invalid_argument);
  {
    NoGradGuard no_grad;
    uniform_(w, 0.5, 1.0, g);
  }
  CHECK(w.requires_grad());
  CHECK(w.to_vector<float>()[0] >= 0.5f);
  Tensor i = zeros({4}, {.dtype = DType::i64});
  CHECK_THROWS_AS(uniform_(i, 0, 1, g), std::invalid_argument);
  Tensor f = zeros({4});
  CHECK_THROWS_AS(uniform_(f, 2, 1, g), std::invalid_argument);
  CHECK_THROWS_AS(normal_(f, 0, -1, g), std::invalid_argument);
}

TEST_CASE("random factories are zero-size safe") {
  Generator g(19);
  CHECK(rand({0, 3}, g).shape() == Shape{0, 3});
  CHECK(randn({0}, g, {.dtype = DType::f64}).shape() == Shape{0});
  CHECK(randn({3, 0}, g).numel() == 0);
  CHECK(randint(0, 5, {2, 0}, g).shape() == Shape{2, 0});
  CHECK(bernoulli({0}, 0.5, g).numel() == 0);
  CHECK(g.offset() == PhiloxOffset{});
  CHECK(rand({}, g).shape() == Shape{});  // 0-d: one element
  CHECK(g.offset().lo == 1);
}

TEST_CASE("dropout: eval and p = 0 are the identity, p = 1 gives zeros") {
  Generator g(20);
  Tensor x = rand({4, 5}, g);
  const PhiloxOffset before = g.offset();
  CHECK(dropout(x, 0.5, false, g).is_same(x));
  CHECK(dropout(x, 0.0, true, g).is_same(x));
  CHECK(g.offset() == before);
  const auto z = dropout(x, 1.0, true, g).to_vector<float>();
  CHECK(std::all_of(z.begin(), z.end(), [](float v) { return v == 0.0f; }));
  CHECK_THROWS_AS(dropout(x, -0.1, true, g), std::invalid_argument);
  CHECK_THROWS_AS(dropout(x, 1.1, false, g), std::invalid_argument);
  CHECK_THROWS_AS(dropout(zeros({2}, {.dtype = DType::i64}), 0.5, true, g), std::invalid_argument);
}

TEST_CASE("dropout: train scaling and gradient equal mask / (1 - p)") {
  for (DType dt : {DType::f32, DType::f64}) {
    Generator g = Generator::named(5, "dropout");
    Tensor x = randn({40, 50}, g, {.dtype = dt}).requires_grad_();
    Generator replay = g;
    const double p = 0.25;
    Tensor y = dropout(x, p, true, g);
    const auto mask = bernoulli({40, 50}, 1 - p, replay, {.dtype = DType::f64}).to_vector<double>();
    const auto xv = x.to_vector<double>(), yv = y.to_vector<double>();
    const double tol = dt == DType::f32 ? 1e-6 : 1e-14;
    for (size_t i = 0; i < xv.size(); ++i)
      CHECK(std::abs(yv[i] - xv[i] * mask[i] / (1 - p)) <= tol * (1 + std::abs(yv[i])));
    sum(y).backward();
    const auto gv = x.grad().to_vector<double>();
    for (size_t i = 0; i < gv.size(); ++i) CHECK(std::abs(gv[i] - mask[i] / (1 - p)) <= tol * 2);
    double dropped = 0;
    for (double m : mask) dropped += m == 0;
    CHECK(dropped / mask.size() == doctest::Approx(p).epsilon(0.15));
  }
}

TEST_CASE("dropout: drop rate on a large input, zero-size input") {
  Generator g(22);
  Tensor x = ones({1000, 1000});
  const auto y = dropout(x, 0.1, true, g).to_vector<float>();
  const auto zeros_n = std::count(y.begin(), y.end(), 0.0f);
  CHECK(static_cast<double>(zeros_n) / 1e6 == doctest::Approx(0.1).epsilon(0.02));
  CHECK(std::all_of(y.begin(), y.end(),
                    [](float v) { return v == 0.0f || v == static_cast<float>(1.0 / 0.9); }));

  Tensor e = zeros({0, 4}).requires_grad_();
  Tensor ye = dropout(e, 0.5, true, g);
  CHECK(ye.shape() == Shape{0, 4});
  sum(ye).backward();
  CHECK(e.grad().shape() == Shape{0, 4});
}

// ---- the shared fill rules (engine/random/draw.h) and the device axis ----

namespace {

struct FillKind {
  RandomDraw draw;
  DType dtype;
};
const FillKind kFills[] = {
    {RandomDraw::uniform, DType::f32},   {RandomDraw::uniform, DType::f64},
    {RandomDraw::uniform, DType::bf16},  {RandomDraw::uniform, DType::f16},
    {RandomDraw::normal, DType::f32},    {RandomDraw::normal, DType::f64},
    {RandomDraw::integer, DType::i64},   {RandomDraw::bernoulli, DType::f32},
    {RandomDraw::bernoulli, DType::f64}, {RandomDraw::bernoulli, DType::bf16},
    {RandomDraw::bernoulli, DType::f16}};

// What the CUDA kernel does, on the CPU: one Philox block at a time through
// draw::fill_block, in the element type of the dtype.
Tensor walk_blocks(const RandomFill& f, int64_t n) {
  Tensor out = zeros({n}, {.dtype = f.dtype});
  const draw::Grouping gr = draw::grouping(f.draw, f.dtype);
  const int64_t groups = draw::groups(gr, n), blocks = draw::blocks(gr, n);
  draw::dispatch_fill<bf16, f16>(gr, f.dtype, [&]<int W, class T>() {
    for (int64_t b = blocks - 1; b >= 0; --b)  // any order: blocks are independent
      draw::fill_block<W>(f, n, groups, b, static_cast<T*>(out.raw_data()));
  });
  return out;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  if (x.dtype() != y.dtype() || x.shape() != y.shape()) return false;
  // An empty tensor may have no storage: memcmp must not see its null pointer.
  return x.numel() == 0 ||
         std::memcmp(x.raw_data(), y.raw_data(),
                     static_cast<size_t>(x.numel()) * element_size(x.dtype())) == 0;
}

// Largest distance in units in the last place of want's floating dtype.
// The largest |got - want| in units in the last place of want's dtype, the
// unit taken at max(|want|, floor): a floor keeps a value that cancelled to
// near zero from magnifying an error its inputs already had.
double max_ulps(const Tensor& got, const Tensor& want, double floor = 0) {
  const auto g = got.to(Device::cpu()).to(DType::f64).to_vector<double>();
  const auto w = want.to(Device::cpu()).to(DType::f64).to_vector<double>();
  const DType t = want.dtype();
  const int digits = t == DType::f64 ? 53 : t == DType::f32 ? 24 : t == DType::bf16 ? 8 : 11;
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    int e = 0;
    std::frexp(std::max(std::abs(w[i]), floor), &e);
    const double ulp = std::ldexp(1.0, e - digits);
    worst = std::max(worst, std::abs(g[i] - w[i]) / ulp);
  }
  return worst;
}

}  // namespace

TEST_CASE("random fill: words taken, groups and Philox blocks per dtype") {
  using draw::words;
  CHECK(words(RandomDraw::uniform, DType::f32, 5) == 5);
  CHECK(words(RandomDraw::uniform, DType::bf16, 5) == 5);
  CHECK(words(RandomDraw::uniform, DType::f64, 5) == 10);
  CHECK(words(RandomDraw::normal, DType::f32, 5) == 6);  // 3 pairs, the last sine dropped
  CHECK(words(RandomDraw::normal, DType::f64, 5) == 12);
  CHECK(words(RandomDraw::integer, DType::i64, 3) == 6);
  CHECK(words(RandomDraw::normal, DType::f32, 0) == 0);
  CHECK(draw::blocks(draw::grouping(RandomDraw::uniform, DType::f32), 5) == 2);
  CHECK(draw::blocks(draw::grouping(RandomDraw::normal, DType::f64), 5) == 3);
  CHECK(draw::blocks(draw::grouping(RandomDraw::integer, DType::i64), 0) == 0);
  CHECK_THROWS_WITH_AS(draw::grouping(RandomDraw::normal, DType::bf16),
                       doctest::Contains("[random fill] no draw rule for dtype bf16"),
                       std::invalid_argument);
  CHECK_THROWS_AS(draw::grouping(RandomDraw::integer, DType::i32), std::invalid_argument);
  // The samplers advance their generator by exactly ceil(words / 4) blocks.
  for (const FillKind& k : kFills)
    for (int64_t n : {0, 1, 3, 5, 8, 1001}) {
      CAPTURE(n);
      Generator g(3);
      const PhiloxOffset before = g.offset();
      if (k.draw == RandomDraw::uniform) rand({n}, g, {.dtype = k.dtype});
      if (k.draw == RandomDraw::normal) randn({n}, g, {.dtype = k.dtype});
      if (k.draw == RandomDraw::integer) randint(-4, 9, {n}, g);
      if (k.draw == RandomDraw::bernoulli) bernoulli({n}, 0.25, g, {.dtype = k.dtype});
      CHECK(g.offset().lo - before.lo ==
            static_cast<uint64_t>((draw::words(k.draw, k.dtype, n) + 3) / 4));
    }
}

TEST_CASE("random fill: the device's block walk equals the CPU's fill, bit for bit") {
  // Sizes around the block edges and a start whose counter carries past 2^64.
  for (const FillKind& k : kFills)
    for (int64_t n : {0, 1, 2, 3, 4, 5, 7, 9, 1031})
      for (uint64_t lo : {uint64_t{0}, ~uint64_t{0} - 1}) {
        CAPTURE(n);
        CAPTURE(lo);
        RandomFill f;
        f.draw = k.draw;
        f.dtype = k.dtype;
        f.key[0] = 0x243f6a88u;
        f.key[1] = 0x85a308d3u;
        f.start_lo = lo;
        f.start_hi = 7;
        f.low = -1000;
        f.range = 12345;
        f.below = draw::bernoulli_below(0.375);
        Tensor cpu = zeros({n}, {.dtype = k.dtype});
        kernels(Device::cpu()).random_fill(f, n, cpu.raw_data());
        CHECK(same_bytes(walk_blocks(f, n), cpu));
        if (k.dtype == DType::f32 || k.dtype == DType::f64) {
          f.affine = true;
          f.scale = -2.5;
          f.shift = 0.75;
          kernels(Device::cpu()).random_fill(f, n, cpu.raw_data());
          CHECK(same_bytes(walk_blocks(f, n), cpu));
        }
      }
}

TEST_CASE("random fill: a bernoulli product's second product, on the block walk and the CPU") {
  for (DType t : {DType::f32, DType::f64})
    for (int64_t n : {0, 1, 5, 1031, 5003}) {
      CAPTURE(dtype_name(t));
      CAPTURE(n);
      Generator init(4);
      const Tensor a = randn({n}, init, {.dtype = t}), b = randn({n}, init, {.dtype = t});
      RandomFill f;
      f.draw = RandomDraw::bernoulli;
      f.dtype = t;
      f.key[0] = 0x13198a2eu;
      f.key[1] = 0x03707344u;
      f.start_hi = 3;
      f.below = draw::bernoulli_below(0.7);
      f.affine = true;  // the scaled mask: 0 or 1 / 0.7
      f.scale = 1.0 / 0.7;
      Tensor mask = zeros({n}, {.dtype = t});
      kernels(Device::cpu()).random_fill(f, n, mask.raw_data());
      f.times = a.raw_data();
      f.times2 = b.raw_data();
      Tensor cpu = zeros({n}, {.dtype = t}), cpu2 = zeros({n}, {.dtype = t});
      f.out2 = cpu2.raw_data();
      kernels(Device::cpu()).random_fill(f, n, cpu.raw_data());
      CHECK(same_bytes(cpu, mul(a, mask)));
      CHECK(same_bytes(cpu2, mul(b, mask)));
      Tensor walked2 = zeros({n}, {.dtype = t});
      f.out2 = walked2.raw_data();
      CHECK(same_bytes(walk_blocks(f, n), cpu));
      CHECK(same_bytes(walked2, cpu2));
    }
}

TEST_CASE("bernoulli_mul_pair: one mask for two tensors, bernoulli_mul's draw and bits") {
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : quanta::testing::test_devices()) devices.push_back(d);
  for (const Device device : devices)
    for (DType t : {DType::f32, DType::f64, DType::bf16}) {
      CAPTURE(device.str());
      CAPTURE(dtype_name(t));
      Generator init(6);
      const TensorOptions o{.dtype = t, .device = device};
      const Tensor a = randn({37, 29}, init, o), b = randn({37, 29}, init, o);
      Generator g1 = Generator::named(2, "pair"), g2 = g1, g3 = g1;
      const auto [pa, pb] = bernoulli_mul_pair(a, b, 0.8, 1.25, g1);
      CHECK(pa.device() == device);
      CHECK(same_bytes(pa, bernoulli_mul(a, 0.8, 1.25, g2)));
      CHECK(same_bytes(pb, mul(b, scaled_bernoulli(a.shape(), 0.8, 1.25, g3, o))));
      CHECK(g1.offset() == g2.offset());
      CHECK(g1.offset() == g3.offset());
      // A strided operand takes the mask-and-products path: the same bits.
      const Tensor bt = b.t().contiguous().t();
      Generator g4 = Generator::named(2, "pair");
      const auto [qa, qb] = bernoulli_mul_pair(a, bt, 0.8, 1.25, g4);
      CHECK(same_bytes(qa, pa));
      CHECK(same_bytes(qb, pb));
    }
  // p = 1 keeps every value (no 32-bit cut expresses it), p = 0 none.
  Generator g(7);
  const Tensor a = rand({4099}, g), b = rand({4099}, g);
  const auto [ka, kb] = bernoulli_mul_pair(a, b, 1.0, 2.0, g);
  CHECK(same_bytes(ka, a * 2.0));
  CHECK(same_bytes(kb, b * 2.0));
  const auto [za, zb] = bernoulli_mul_pair(a, b, 0.0, 2.0, g);
  CHECK(same_bytes(za, a * 0.0));
  CHECK(same_bytes(zb, b * 0.0));
  CHECK_THROWS_WITH_AS(bernoulli_mul_pair(a, ones({3}), 0.5, 2.0, g),
                       doctest::Contains("[bernoulli_mul_pair] a and b must share shape"),
                       std::invalid_argument);
}

TEST_CASE(
    "cuda: random fills on the device equal the CPU stream (uniform, integer, bernoulli bitwise)") {
  if (!quanta::testing::have_gpu()) MESSAGE("cuda:0 skipped: " << quanta::testing::no_gpu_reason());
  for (const Device gpu : quanta::testing::test_devices()) {
    INFO("on ", gpu.str());
    for (int64_t n : {0, 1, 5, 4099, 1 << 20}) {
      CAPTURE(n);
      for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
        CAPTURE(dtype_name(t));
        Generator a = Generator::named(11, "device"), b = a;
        const Tensor c = rand({n}, a, {.dtype = t}), d = rand({n}, b, {.dtype = t, .device = gpu});
        CHECK(d.device() == gpu);
        CHECK(same_bytes(d, c));
        CHECK(a.offset() == b.offset());
        const Tensor zc = randn({n}, a, {.dtype = t}),
                     zd = randn({n}, b, {.dtype = t, .device = gpu});
        CHECK(a.offset() == b.offset());
        // Box-Muller runs CUDA's f64 log, sin and cos (documented at 1 and 2
        // ulps) where the CPU runs glibc's: f32 and narrower results are
        // within one ulp of their dtype, f64 ones within a few.
        const double ulps = t == DType::f64 ? 4.0 : 1.0;
        CHECK(max_ulps(zd, zc) <= ulps);
        // In place on a strided device view: the fill's values land where the CPU's do.
        Tensor hc = zeros({n, 2}, {.dtype = t}), hd = zeros({n, 2}, {.dtype = t, .device = gpu});
        uniform_(hc.select(1, 1), -3.0, 5.0, a);
        uniform_(hd.select(1, 1), -3.0, 5.0, b);
        CHECK(same_bytes(hd, hc));
        normal_(hc.select(1, 0), 2.0, 0.5, a);
        normal_(hd.select(1, 0), 2.0, 0.5, b);
        // 2 + 0.5 z cancels to near 0 where z is near -4 (about 60 of 2^20
        // draws): z's few ulps then become many of the result's (128 on the
        // first GPU), so they are counted at the scale of the terms.
        CHECK(max_ulps(hd, hc, 4.0) <= ulps);
        CHECK(a.offset() == b.offset());
      }
      Generator a(5), b(5);
      for (DType t : {DType::i64, DType::i32, DType::u8, DType::f32}) {
        const int64_t lo = t == DType::u8 ? 0 : -1000000007, hi = t == DType::u8 ? 256 : 1000000007;
        CHECK(same_bytes(randint(lo, hi, {n}, b, {.dtype = t, .device = gpu}),
                         randint(lo, hi, {n}, a, {.dtype = t})));
      }
      CHECK(same_bytes(
          randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {n}, b,
                  {.dtype = DType::i64, .device = gpu}),
          randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {n},
                  a)));
      CHECK(a.offset() == b.offset());
      // Bernoulli (and so dropout's mask) is drawn on the device, in every dtype.
      for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::u8, DType::boolean})
        for (double p : {0.0, 0.3, 1.0}) {
          const Tensor m = bernoulli({n}, p, b, {.dtype = t, .device = gpu});
          CHECK(m.device() == gpu);
          CHECK(same_bytes(m, bernoulli({n}, p, a, {.dtype = t})));
        }
      // The scaled mask dropout draws (one affine bernoulli fill in f32 and f64).
      for (DType t : {DType::f32, DType::f64, DType::bf16})
        CHECK(same_bytes(scaled_bernoulli({n}, 0.7, 1 / 0.7, b, {.dtype = t, .device = gpu}),
                         scaled_bernoulli({n}, 0.7, 1 / 0.7, a, {.dtype = t})));
      const Tensor x = rand({n}, a), xd = rand({n}, b, {.device = gpu});  // both streams advance
      Generator da = Generator::named(3, "dropout"), db = da;
      Tensor xg = x.clone().requires_grad_(), xdg = xd.clone().requires_grad_();
      const Tensor y = dropout(xg, 0.25, true, da), yd = dropout(xdg, 0.25, true, db);
      CHECK(same_bytes(yd, y));
      // The backward draws the mask again, on the device too.
      sum(yd).backward();
      sum(y).backward();
      CHECK(same_bytes(xdg.grad(), xg.grad()));
      CHECK(a.offset() == b.offset());
      CHECK(da.offset() == db.offset());
    }
  }
}

TEST_CASE("dropout: keeps no mask for the backward, which draws the same one again") {
  // The forward's output is the only new memory the graph holds (a mask of
  // the input's size was kept before); the backward's gradient equals the
  // forward's mask, and the generator advanced once, by the forward.
  Generator g = Generator::named(6, "dropout.memory");
  const int64_t n = int64_t{1} << 21;  // 8 MiB of f32: cached blocks, counted
  Tensor x = randn({n}, g).requires_grad_();
  const std::size_t before = cpu::block_cache_stats().in_use;
  Tensor y = dropout(x, 0.5, true, g);
  // (Sanitized builds keep no blocks and count none.)
  if (cpu::block_cache_stats().bound > 0)
    CHECK(cpu::block_cache_stats().in_use - before == y.nbytes());
  const PhiloxOffset after_forward = g.offset();
  y.backward(ones({n}));
  CHECK(g.offset() == after_forward);
  // y = x * mask * 2 and dy/dx = mask * 2: where x is nonzero they agree.
  const auto xv = x.to_vector<float>(), yv = y.to_vector<float>(), gv = x.grad().to_vector<float>();
  bool same = true;
  for (size_t i = 0; i < xv.size(); ++i)
    if (xv[i] != 0) same = same && gv[i] == yv[i] / xv[i] * 1.0f;
  CHECK(same);
}

TEST_CASE("dropout_linear: linear(dropout(x))'s draws, values and gradients, keeping x") {
  // Shapes around the CPU kernel's tiles: rows in one or several blocks
  // with a partial tile of 8, k under 16, at and past a multiple of 16, r
  // below 16, at it and with a partial second chunk; each against the two
  // ops, within the rounding of the sums' order.
  struct Dims {
    Shape x;
    int64_t r;
  };
  for (const Dims& dims : {Dims{{3, 5, 40}, 7}, Dims{{4, 3, 5}, 2}, Dims{{1, 16}, 16},
                           Dims{{130, 33}, 20}, Dims{{2, 75, 1300}, 16}, Dims{{21, 3456}, 3}})
    for (DType dt : {DType::f32, DType::f64}) {
      const std::string shape = shape_str(dims.x) + " r " + std::to_string(dims.r);
      INFO(shape);
      CAPTURE(dt);
      Generator init(8);
      const Tensor x0 = randn(dims.x, init, {.dtype = dt}),
                   w0 = randn({dims.r, dims.x.back()}, init, {.dtype = dt});
      Shape out_shape = dims.x;
      out_shape.back() = dims.r;
      const Tensor probe = randn(out_shape, init, {.dtype = dt});
      Tensor x1 = x0.clone().requires_grad_(), w1 = w0.clone().requires_grad_();
      Tensor x2 = x0.clone().requires_grad_(), w2 = w0.clone().requires_grad_();
      Generator g1 = Generator::named(9, "dropout_linear"), g2 = g1;
      const Tensor y1 = dropout_linear(x1, w1, 0.3, true, g1);
      const Tensor y2 = linear(dropout(x2, 0.3, true, g2), w2);
      CHECK(g1.offset() == g2.offset());
      const double tol = dt == DType::f32 ? 1e-5 : 1e-13;
      CHECK(max_rel_diff(y1, y2) < tol);
      sum(y1 * probe).backward();
      sum(y2 * probe).backward();
      CHECK(max_rel_diff(x1.grad(), x2.grad()) < tol);
      CHECK(max_rel_diff(w1.grad(), w2.grad()) < tol);
      // The same elements dropped in the input's gradient.
      const auto gx1 = x1.grad().to_vector<double>(), gx2 = x2.grad().to_vector<double>();
      bool same_zeros = true;
      for (size_t i = 0; i < gx1.size(); ++i)
        same_zeros = same_zeros && (gx1[i] == 0) == (gx2[i] == 0);
      CHECK(same_zeros);
      // One gradient alone: the kernel's other half skipped.
      Tensor x3 = x0.clone().requires_grad_();
      Generator g3 = Generator::named(9, "dropout_linear");
      sum(dropout_linear(x3, w0, 0.3, true, g3) * probe).backward();
      CHECK(max_rel_diff(x3.grad(), x2.grad()) < tol);
      Tensor w4 = w0.clone().requires_grad_();
      Generator g4 = Generator::named(9, "dropout_linear");
      sum(dropout_linear(x0, w4, 0.3, true, g4) * probe).backward();
      CHECK(max_rel_diff(w4.grad(), w2.grad()) < tol);
      // Evaluation and p = 0: the plain product, no draw.
      const PhiloxOffset before = g1.offset();
      CHECK(max(abs(dropout_linear(x0, w0, 0.3, false, g1) - linear(x0, w0))).item() == 0);
      CHECK(max(abs(dropout_linear(x0, w0, 0.0, true, g1) - linear(x0, w0))).item() == 0);
      // ... times a scale where one is given: the product's bits scaled.
      CHECK(max(abs(dropout_linear(x0, w0, 0.3, false, g1, 0.75) - linear(x0, w0) * 0.75)).item() ==
            0);
      CHECK(max(abs(dropout_linear(x0, w0, 0.0, true, g1, 0.75) - linear(x0, w0) * 0.75)).item() ==
            0);
      CHECK(g1.offset() == before);
      // In training the scale rides on the mask: the same draws, the values
      // and both gradients of the two ops and a multiplication.
      Tensor x5 = x0.clone().requires_grad_(), w5 = w0.clone().requires_grad_();
      Generator g5 = Generator::named(9, "dropout_linear");
      const Tensor y5 = dropout_linear(x5, w5, 0.3, true, g5, 2.0 / 3.0);
      CHECK(g5.offset() == g2.offset());
      CHECK(max_rel_diff(y5, y2 * (2.0 / 3.0)) < tol);
      sum(y5 * probe).backward();
      CHECK(max_rel_diff(x5.grad(), x2.grad() * (2.0 / 3.0)) < tol);
      CHECK(max_rel_diff(w5.grad(), w2.grad() * (2.0 / 3.0)) < tol);
    }
  {
    Generator g = Generator::named(9, "dropout_linear");
    CHECK_THROWS_WITH_AS(dropout_linear(ones({2, 3}), ones({4, 3}), 0.1, true, g, NAN),
                         doctest::Contains("[dropout_linear] scale must be finite"),
                         std::invalid_argument);
  }
  // The same bits on one thread as on several where the CPU's fused kernel
  // runs (f64 everywhere, f32 with AVX-512; f32 without it takes the
  // library GEMM's order): the weight gradient sums fixed chunks of rows in
  // order.
  std::vector<DType> fused{DType::f64};
#if defined(__AVX512F__)
  fused.push_back(DType::f32);
#endif
  for (const DType dt : fused) {
    CAPTURE(dt);
    Generator init(11);
    const Tensor x0 = randn({700, 300}, init, {.dtype = dt}),
                 w0 = randn({16, 300}, init, {.dtype = dt});
    const Tensor probe = randn({700, 16}, init, {.dtype = dt});
    const auto run = [&](int threads) {
      const int was = num_threads();
      set_num_threads(threads);
      Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      Generator g = Generator::named(3, "threads");
      const Tensor y = dropout_linear(x, w, 0.1, true, g);
      sum(y * probe).backward();
      set_num_threads(was);
      return std::vector<std::vector<double>>{y.to_vector<double>(), x.grad().to_vector<double>(),
                                              w.grad().to_vector<double>()};
    };
    CHECK(run(1) == run(2));
  }
  // The graph holds no dropped copy of a large input (cached blocks, counted
  // where the cache is on): only the small output (256 KiB, also a cached
  // block since they start at 64 KiB) and what the op keeps beside it, far
  // below the input's 8 MiB; the unfused pair keeps the dropped copy.
  Generator g(10);
  const Tensor x = (randn({4096, 512}, g) * 1.0).requires_grad_();  // 8 MiB
  const Tensor w = randn({16, 512}, g).requires_grad_();
  const std::size_t before = cpu::block_cache_stats().in_use;
  Tensor y = dropout_linear(x, w, 0.1, true, g);
  const std::size_t kept = cpu::block_cache_stats().in_use - before;
  if (cpu::block_cache_stats().bound > 0) CHECK(kept < x.nbytes() / 8);
  Tensor y2 = linear(dropout(x, 0.1, true, g), w);
  if (cpu::block_cache_stats().bound > 0)
    CHECK(cpu::block_cache_stats().in_use - before - kept >= x.nbytes());
}
