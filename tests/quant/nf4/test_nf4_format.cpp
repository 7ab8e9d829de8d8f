// The NF4 format against a scalar reference written from the spec
// (../shared/reference/nf4.md): nearest code with ties to the lower code,
// blocks of the flat tensor, high nibble = even element, f32 scale products.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "quant/nf4/double_quant.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quanta.h"

using namespace quanta;
using namespace quanta::quant;

namespace {

// ---- scalar reference, independent of the kernels ----

// Nearest NF4 value by exact distance; a value on a float32 midpoint (or an
// exact tie) takes the lower code.
uint8_t ref_code(float s) {
  int best = 0;
  for (int i = 1; i < 16; ++i) {
    const double d_best = std::fabs(double(s) - kNF4Values[best]);
    const double d_i = std::fabs(double(s) - kNF4Values[i]);
    const float mid = (kNF4Values[i - 1] + kNF4Values[i]) / 2.0f;
    if (d_i < d_best && s != mid) best = i;
  }
  return static_cast<uint8_t>(best);
}

struct RefQuant {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // per block (exact absmax)
};

RefQuant ref_quantize(const std::vector<float>& x, int64_t bs) {
  RefQuant r;
  const int64_t n = static_cast<int64_t>(x.size());
  for (int64_t b = 0; b * bs < n; ++b) {
    const int64_t lo = b * bs, hi = std::min(n, lo + bs);
    float a = 0;
    for (int64_t i = lo; i < hi; ++i) a = std::max(a, std::fabs(x[i]));
    r.scales.push_back(a);
    const float am = std::max(a, 1e-38f);
    for (int64_t i = lo; i < hi; ++i) {
      float s = hi - lo == bs ? x[i] * (1.0f / am) : x[i] / am;
      s = std::min(1.0f, std::max(-1.0f, s));
      r.codes.push_back(ref_code(s));
    }
  }
  return r;
}

Tensor f32(const std::vector<float>& v, Shape shape = {}) {
  return from_vector(v, shape.empty() ? Shape{static_cast<int64_t>(v.size())} : shape);
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

// The codes of bitsandbytes' packed bytes, high nibble first.
std::vector<uint8_t> unpack(const BnbNF4State& s) {
  const int64_t n = numel_of(s.shape);
  const uint8_t* p = s.packed.data<uint8_t>();
  std::vector<uint8_t> c(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) c[i] = i % 2 == 0 ? p[i / 2] >> 4 : p[i / 2] & 15;
  return c;
}

NF4Options no_dq(int64_t bs = 64) {
  NF4Options o;
  o.block_size = bs;
  o.double_quant = false;
  return o;
}

// Blocks of 64 covering the cases the spec names.
std::vector<float> special_weight() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x;
  auto block = [&](auto f) {
    for (int i = 0; i < 64; ++i) x.push_back(f(i));
  };
  const auto& mids = nf4_midpoints();
  // ties: absmax 2, elements 2 * midpoint and one ulp either side, +-2.
  block([&](int i) -> float {
    if (i == 0) return 2.0f;
    if (i == 1) return -2.0f;
    const int m = (i - 2) % 15, kind = (i - 2) / 15;
    const float t = 2.0f * mids[m];
    if (kind == 0) return t;
    if (kind == 1) return std::nextafter(t, 10.0f);
    if (kind == 2) return std::nextafter(t, -10.0f);
    return 0.5f;
  });
  block([](int) { return 0.0f; });                          // all zero
  block([](int i) { return i == 17 ? 3.5f : 0.0f; });       // single nonzero
  block([](int i) { return i == 40 ? -1e-3f : 0.0f; });     // single negative
  block([&](int) { return nd(rng) * 1e36f; });              // huge
  block([&](int) { return nd(rng) * 1e-30f; });             // tiny
  block([&](int) { return -std::fabs(nd(rng)) - 0.1f; });   // negative only
  block([&](int i) { return kNF4Values[i % 16] * 1.5f; });  // all 16 codes
  for (int b = 0; b < 8; ++b) block([&](int) { return nd(rng) * std::pow(10.0f, b - 4); });
  return x;
}

}  // namespace

TEST_CASE("nf4 code table: 16 values, midpoints as bitsandbytes' thresholds") {
  const auto& m = nf4_midpoints();
  for (int i = 0; i < 15; ++i) {
    CHECK(kNF4Values[i] < kNF4Values[i + 1]);
    CHECK(m[i] == float((double(kNF4Values[i]) + double(kNF4Values[i + 1])) / 2.0));
  }
  CHECK(m[7] == 0.03979014977812767f);
  CHECK(nf4_code(m[7]) == 7);
  CHECK(nf4_code(std::nextafter(m[7], 1.0f)) == 8);
  CHECK(nf4_code(1.0f) == 15);
  CHECK(nf4_code(-1.0f) == 0);
  CHECK(nf4_code(0.0f) == 7);
}

TEST_CASE("nf4 quantize matches the scalar reference: ties, zero, single, extremes") {
  const std::vector<float> x = special_weight();
  for (int64_t bs : {64, 128, 256}) {
    CAPTURE(bs);
    const RefQuant ref = ref_quantize(x, bs);
    const Tensor q = quantize_nf4(f32(x), no_dq(bs));
    CHECK(q.dtype() == DType::nf4);
    CHECK(q.nbytes() == (x.size() / 64) * 36);
    const Tensor codes = nf4_codes(q);
    const uint8_t* pc = codes.data<uint8_t>();
    int64_t wrong = 0;
    for (size_t i = 0; i < x.size(); ++i) wrong += pc[i] != ref.codes[i];
    CHECK(wrong == 0);
    const Tensor scales = nf4_unit_scales(q);
    const Tensor deq = dequantize(q);
    for (size_t i = 0; i < x.size(); ++i) {
      const float s = ref.scales[i / bs];
      REQUIRE(scales.data<float>()[i / 64] == s);
      REQUIRE(deq.data<float>()[i] == kNF4Values[ref.codes[i]] * s);
    }
  }
  // bitsandbytes' layout at every block size, 32 included: the same codes,
  // the exact absmax per block and the same values.
  for (int64_t bs : {32, 64, 128, 256}) {
    CAPTURE(bs);
    const RefQuant ref = ref_quantize(x, bs);
    const BnbNF4State s = quantize_bnb(f32(x), no_dq(bs));
    CHECK(s.blocksize == bs);
    CHECK(s.packed.shape() == Shape{static_cast<int64_t>(x.size()) / 2, 1});
    CHECK(unpack(s) == ref.codes);
    CHECK(s.absmax.to_vector<float>() == ref.scales);
    const Tensor deq = dequantize(s);
    int64_t wrong = 0;
    for (size_t i = 0; i < x.size(); ++i)
      wrong += deq.data<float>()[i] != kNF4Values[ref.codes[i]] * ref.scales[i / bs];
    CHECK(wrong == 0);
    if (bs % 64 == 0) {
      // The nf4 dtype's export at the same block size is the same state.
      const BnbNF4State e = to_bnb(quantize_nf4(f32(x), no_dq(bs)), false, bs);
      CHECK(bytes_of(e.packed) == bytes_of(s.packed));
      CHECK(bytes_of(e.absmax) == bytes_of(s.absmax));
    }
  }
  // The tie block spelled out: on a midpoint -> lower code, one ulp up -> upper.
  const Tensor codes = nf4_codes(quantize_nf4(f32(x), no_dq()));
  const uint8_t* c = codes.data<uint8_t>();
  CHECK(c[0] == 15);
  CHECK(c[1] == 0);
  for (int m = 0; m < 15; ++m) {
    CHECK(c[2 + m] == m);
    CHECK(c[17 + m] == m + 1);
    CHECK(c[32 + m] == m);
  }
  for (int i = 64; i < 128; ++i) CHECK(c[i] == 7);  // all-zero block
  CHECK(c[128 + 17] == 15);
  CHECK(c[192 + 40] == 0);
}

TEST_CASE("nf4 packing: high nibble is the even element, padding is code 7") {
  // codes [15, 0, 7, 8]: values absmax, -absmax, 0, 0.0796 * absmax.
  const Tensor q = quantize_nf4(f32({2.0f, -2.0f, 0.0f, 2.0f * kNF4Values[8]}), no_dq());
  const auto b = bytes_of(q);
  REQUIRE(b.size() == 36);
  CHECK(b[0] == 0xF0);
  CHECK(b[1] == 0x78);
  for (int j = 2; j < 32; ++j) CHECK(b[j] == 0x77);
  float s;
  std::memcpy(&s, b.data() + 32, 4);
  CHECK(s == 2.0f);
  const BnbNF4State bnb = to_bnb(q, false);
  CHECK(bnb.packed.shape() == Shape{2, 1});
  // Odd element count: the last byte's low nibble is padding code 7.
  const BnbNF4State odd = to_bnb(quantize_nf4(f32({2.0f, -2.0f, 2.0f}), no_dq()), false);
  CHECK(odd.packed.shape() == Shape{2, 1});
  CHECK(odd.packed.data<uint8_t>()[1] == 0xF7);
}

TEST_CASE("nf4 dequantize: f32, bf16 and f16 round the f32 product to nearest even") {
  const Tensor q = quantize_nf4(f32({2.0f * kNF4Values[14], 2.0f}), no_dq());
  const Tensor b = dequantize(q, DType::bf16);
  uint16_t bits;
  std::memcpy(&bits, b.raw_data(), 2);
  CHECK(bits == 0x3FB9);  // 1.4453125
  CHECK(dequantize(q, DType::f16).to(DType::f32).data<float>()[0] ==
        static_cast<float>(f16(kNF4Values[14] * 2.0f)));
  CHECK_THROWS_WITH_AS(dequantize(q, DType::f64), doctest::Contains("f32, bf16 or f16"),
                       std::invalid_argument);
}

TEST_CASE("nf4 round trip: per-block error within half the largest code gap") {
  Generator gen(11);
  const Tensor x = randn({96, 160}, gen) * 3.0;
  double max_gap = 0;
  for (int i = 0; i < 15; ++i)
    max_gap = std::max(max_gap, double(kNF4Values[i + 1] - kNF4Values[i]));
  for (bool dq : {false, true}) {
    for (int64_t bs : {64, 128, 256}) {
      CAPTURE(dq);
      CAPTURE(bs);
      NF4Options o;
      o.block_size = bs;
      o.double_quant = dq;
      const Tensor q = quantize_nf4(x, o);
      const Tensor d = dequantize(q);
      const float* px = x.data<float>();
      const float* pd = d.data<float>();
      const Tensor scales = nf4_unit_scales(q);
      const float* ps = scales.data<float>();
      const int64_t n = x.numel();
      for (int64_t b = 0; b * bs < n; ++b) {
        double amax = 0, err = 0;
        for (int64_t i = b * bs; i < std::min(n, (b + 1) * bs); ++i) {
          amax = std::max(amax, double(std::fabs(px[i])));
          err = std::max(err, std::fabs(double(px[i]) - pd[i]));
        }
        // With double quant the scale itself moved by |stored - absmax|.
        const double scale_err = std::fabs(double(ps[b * bs / 64]) - amax);
        CHECK(err <= 0.5 * max_gap * amax + scale_err + 1e-6 * amax);
        if (dq)
          CHECK(scale_err <= 0.02 * amax);
        else
          CHECK(scale_err == 0.0);
      }
    }
  }
}

TEST_CASE("nf4 block 32: round trip within the per-block bound, with and without double quant") {
  Generator gen(12);
  const Tensor x = randn({96, 160}, gen) * 3.0;
  double max_gap = 0;
  for (int i = 0; i < 15; ++i)
    max_gap = std::max(max_gap, double(kNF4Values[i + 1] - kNF4Values[i]));
  const BnbNF4State plain = quantize_bnb(x, no_dq(32));
  const std::vector<uint8_t> codes = unpack(plain);
  for (bool dq : {false, true}) {
    CAPTURE(dq);
    NF4Options o = no_dq(32);
    o.double_quant = dq;
    const BnbNF4State s = quantize_bnb(x, o);
    CHECK(s.double_quant == dq);
    CHECK(s.absmax.numel() == 96 * 160 / 32);
    CHECK(s.absmax.dtype() == (dq ? DType::u8 : DType::f32));
    // Codes always come from the exact absmax.
    CHECK(unpack(s) == codes);
    const Tensor scales = bnb_scales(s);
    if (dq) {
      // bitsandbytes' reconstruction of the double-quantized exact scales.
      const Tensor exact = plain.absmax;
      const std::vector<float> rec =
          double_dequantize(double_quantize(exact.data<float>(), exact.numel()));
      CHECK(scales.to_vector<float>() == rec);
      CHECK(s.nested_absmax.numel() == 2);  // 480 blocks: a full and a partial group
    }
    const Tensor d = dequantize(s);
    const float* px = x.data<float>();
    const float* pd = d.data<float>();
    const float* ps = scales.data<float>();
    for (int64_t b = 0; b < x.numel() / 32; ++b) {
      double amax = 0, err = 0;
      for (int64_t i = b * 32; i < (b + 1) * 32; ++i) {
        amax = std::max(amax, double(std::fabs(px[i])));
        err = std::max(err, std::fabs(double(px[i]) - pd[i]));
        REQUIRE(pd[i] == kNF4Values[codes[i]] * ps[b]);
      }
      const double scale_err = std::fabs(double(ps[b]) - amax);
      CHECK(err <= 0.5 * max_gap * amax + scale_err + 1e-6 * amax);
      if (dq)
        CHECK(scale_err <= 0.02 * amax);
      else
        CHECK(scale_err == 0.0);
    }
  }
  // Smaller blocks, smaller error.
  const Tensor d32 = dequantize(plain);
  const Tensor d64 = dequantize(quantize_nf4(x, no_dq(64)));
  CHECK(mean((d32 - x) * (d32 - x)).item() < mean((d64 - x) * (d64 - x)).item());
}

TEST_CASE("nf4 block 32 in bitsandbytes' layout: shapes, dtypes, files and conversions") {
  Generator gen(14);
  // 111 elements: three full blocks and a partial one, odd count.
  const Tensor x = randn({3, 37}, gen);
  const BnbNF4State s = quantize_bnb(x, no_dq(32));
  CHECK(s.packed.shape() == Shape{56, 1});
  CHECK((s.packed.data<uint8_t>()[55] & 0x0F) == kNF4ZeroCode);
  const RefQuant ref = ref_quantize(x.to_vector<float>(), 32);
  CHECK(unpack(s) == ref.codes);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor d = dequantize(s, dt);
    CHECK(d.dtype() == dt);
    CHECK(d.shape() == Shape{3, 37});
    for (int64_t i = 0; i < 111; ++i) {
      const float v = kNF4Values[ref.codes[i]] * ref.scales[i / 32];
      const float want = dt == DType::bf16 ? float(bf16(v)) : dt == DType::f16 ? float(f16(v)) : v;
      REQUIRE(d.to(DType::f32).data<float>()[i] == want);
    }
  }
  // Zero-size.
  const BnbNF4State z = quantize_bnb(zeros({0, 32}), no_dq(32));
  CHECK(z.packed.numel() == 0);
  CHECK(dequantize(z).shape() == Shape{0, 32});
  // safetensors round trip under bitsandbytes' names, with double quant.
  const Tensor w = randn({64, 96}, gen);
  NF4Options dq32 = no_dq(32);
  dq32.double_quant = true;
  const BnbNF4State sdq = quantize_bnb(w, dq32);
  io::TensorMap out;
  append_bnb_tensors(out, "w", sdq);
  const auto file = io::parse_safetensors(io::serialize_safetensors(out));
  const std::map<std::string, Tensor> t(file.tensors.begin(), file.tensors.end());
  const BnbNF4State back = read_bnb_tensors(t, "w");
  CHECK(back.blocksize == 32);
  CHECK(back.double_quant);
  CHECK(dequantize(back).to_vector<float>() == dequantize(sdq).to_vector<float>());
  // The nf4 dtype cannot hold it, and says why.
  CHECK_THROWS_WITH_AS(from_bnb(back), doctest::Contains("block-32"), std::invalid_argument);
  // Double quant on and off: same codes, scales as bitsandbytes reconstructs them.
  const BnbNF4State undone = to_bnb(sdq, false);
  CHECK(!undone.double_quant);
  CHECK(undone.absmax.to_vector<float>() == bnb_scales(sdq).to_vector<float>());
  CHECK(bytes_of(undone.packed) == bytes_of(sdq.packed));
  // torchao at block 32 (numel % (32 * 256) == 0): same codes, close values.
  const Tensor big = randn({64, 128}, gen);
  const BnbNF4State b32 = quantize_bnb(big, no_dq(32));
  const TorchaoNF4State ao = to_torchao(b32);
  CHECK(ao.block_size == 32);
  CHECK(ao.quantized_scalers.numel() == 256);
  const BnbNF4State from_ao = to_bnb(ao);
  CHECK(from_ao.blocksize == 32);
  CHECK(unpack(from_ao) == unpack(b32));
  CHECK(max(abs(torchao_dequantize(ao) - dequantize(b32))).item() < 0.02 * max(abs(big)).item());
  CHECK(max(abs(dequantize(from_ao) - dequantize(b32))).item() < 0.02 * max(abs(big)).item());
  CHECK_THROWS_WITH_AS(to_torchao(s), doctest::Contains("8192"), std::invalid_argument);
}

TEST_CASE("nf4 to_bnb at a block size checks the tensor was quantized with it") {
  Generator gen(15);
  const Tensor x = randn({4, 256}, gen);
  const BnbNF4State e = to_bnb(quantize_nf4(x, no_dq(128)), false, 128);
  CHECK(e.blocksize == 128);
  CHECK(e.absmax.numel() == 8);
  CHECK(bytes_of(from_bnb(e)) == bytes_of(quantize_nf4(x, no_dq(128))));
  CHECK_THROWS_WITH_AS(to_bnb(quantize_nf4(x, no_dq(64)), false, 128),
                       doctest::Contains("not quantized with block size 128"),
                       std::invalid_argument);
}

TEST_CASE("nf4 options: validation and bits per parameter") {
  NF4Options o;
  // Block 64 with double quant: bitsandbytes' layout 4.127, the nf4 dtype 4.5.
  CHECK(bits_per_parameter(o).bnb == doctest::Approx(4.126953125));
  CHECK(std::round(bits_per_parameter(o).bnb * 1000) / 1000 == doctest::Approx(4.127));
  CHECK(bits_per_parameter(o).stored == 4.5);
  CHECK(bits_per_parameter(no_dq()).bnb == 4.5);
  CHECK(bits_per_parameter(no_dq()).stored == 4.5);
  CHECK(bits_per_parameter(no_dq(256)).bnb == 4.125);
  CHECK(bits_per_parameter(no_dq(256)).stored == 4.5);
  // Block 32 lives in bitsandbytes' layout: stored is what that costs.
  CHECK(bits_per_parameter(no_dq(32)).bnb == 5.0);
  CHECK(bits_per_parameter(no_dq(32)).stored == 5.0);
  o.block_size = 32;
  CHECK(bits_per_parameter(o).bnb == doctest::Approx(4.25390625));
  CHECK(bits_per_parameter(o).stored == bits_per_parameter(o).bnb);
  // The figures are what the objects hold: a weight of whole 256-block groups.
  Generator gen(8);
  const Tensor w = randn({256, 256}, gen);
  for (int64_t bs : {32, 64, 128, 256})
    for (bool dq : {false, true}) {
      CAPTURE(bs);
      CAPTURE(dq);
      NF4Options p = no_dq(bs);
      p.double_quant = dq;
      const double n = double(w.numel());
      CHECK(8.0 * double(bnb_payload_bytes(quantize_bnb(w, p))) / n ==
            doctest::Approx(bits_per_parameter(p).bnb));
      if (bs != 32)
        CHECK(8.0 * double(quantize_nf4(w, p).nbytes()) / n == bits_per_parameter(p).stored);
    }
  CHECK_NOTHROW(check_options(o));
  CHECK_THROWS_WITH_AS(quantize_nf4(zeros({64}), o), doctest::Contains("quantize_bnb"),
                       std::invalid_argument);
  o.block_size = 48;
  CHECK_THROWS_WITH_AS(check_options(o), doctest::Contains("32, 64, 128 or 256"),
                       std::invalid_argument);
  o.block_size = 64;
  o.dequant_dtype = DType::i32;
  CHECK_THROWS_AS(check_options(o), std::invalid_argument);
  CHECK_THROWS_WITH_AS(quantize_nf4(zeros({4}, {.dtype = DType::i64})),
                       doctest::Contains("floating"), std::invalid_argument);
}

TEST_CASE("nf4 options: dequantize honours dequant_dtype") {
  Generator gen(16);
  const Tensor q = quantize_nf4(randn({5, 64}, gen));
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    NF4Options o;
    o.dequant_dtype = dt;
    const Tensor d = dequantize(q, o);
    CHECK(d.dtype() == dt);
    CHECK(bytes_of(d) == bytes_of(dequantize(q, dt)));
  }
  NF4Options bad;
  bad.dequant_dtype = DType::f64;
  CHECK_THROWS_WITH_AS(dequantize(q, bad), doctest::Contains("f32, bf16 or f16"),
                       std::invalid_argument);
}

TEST_CASE("nf4 shapes: zero-size, partial last unit, odd element counts") {
  const Tensor z = quantize_nf4(zeros({0, 64}));
  CHECK(z.shape() == Shape{0, 64});
  CHECK(z.nbytes() == 0);
  CHECK(dequantize(z).shape() == Shape{0, 64});
  CHECK(dequantize(z, DType::bf16).numel() == 0);

  Generator gen(3);
  const Tensor x = randn({3, 37}, gen);  // 111 elements: a full and a partial block
  const Tensor q = quantize_nf4(x, no_dq());
  CHECK(q.nbytes() == 2 * 36);
  const auto b = bytes_of(q);
  // Elements 111..127 are padding: code 7 in both nibbles from byte 56 on.
  CHECK((b[36 + 23] & 0x0F) == 7);
  for (int j = 36 + 24; j < 36 + 32; ++j) CHECK(b[j] == 0x77);
  const Tensor d = dequantize(q);
  CHECK(d.shape() == Shape{3, 37});
  const RefQuant ref = ref_quantize(x.to_vector<float>(), 64);
  for (int64_t i = 0; i < 111; ++i)
    CHECK(d.data<float>()[i] == kNF4Values[ref.codes[i]] * ref.scales[i / 64]);
}

TEST_CASE("nf4 tensors refuse arithmetic, naming the op and the dtype") {
  const Tensor q = quantize_nf4(ones({2, 64}));
  CHECK_THROWS_WITH_AS(add(q, q), doctest::Contains("[add] dtype nf4"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(q * 2.0, doctest::Contains("[mul] dtype nf4"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(exp(q), doctest::Contains("[exp] dtype nf4"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(sum(q), doctest::Contains("[sum] dtype nf4"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(matmul(q, ones({64, 2})), doctest::Contains("[matmul] dtype nf4"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(linear(ones({1, 64}), q), doctest::Contains("[linear] dtype nf4"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(q.to(DType::f32), doctest::Contains("[to_dtype] dtype nf4"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(cat({q, q}, 0), doctest::Contains("[cat] dtype nf4"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(dequantize(ones({64})), doctest::Contains("expects an nf4 tensor"),
                       std::invalid_argument);
}

TEST_CASE("nf4 byte moves: clone, copy, to(device) and row slices move bytes only") {
  Generator gen(5);
  const Tensor x = randn({8, 128}, gen);
  const Tensor q = quantize_nf4(x);
  const auto bytes = bytes_of(q);
  CHECK(bytes_of(q.clone()) == bytes);
  CHECK(bytes_of(q.to(Device::cpu())) == bytes);
  Tensor dst = empty({8, 128}, {.dtype = DType::nf4});
  copy_(dst, q);
  CHECK(bytes_of(dst) == bytes);
  // Rows 2..5 of a [8, 128] weight are one byte range: 2 units per row.
  const Tensor rows = q.slice(0, 2, 5);
  const auto rb = bytes_of(rows.contiguous());
  CHECK(rb == std::vector<uint8_t>(bytes.begin() + 2 * 72, bytes.begin() + 5 * 72));
  CHECK(dequantize(rows).to_vector<float>() ==
        dequantize(q).slice(0, 2, 5).contiguous().to_vector<float>());
  // A concatenation of row shards (what all-gather does) is the whole tensor.
  std::vector<uint8_t> gathered = bytes_of(q.slice(0, 0, 3).contiguous());
  const auto rest = bytes_of(q.slice(0, 3, 8).contiguous());
  gathered.insert(gathered.end(), rest.begin(), rest.end());
  CHECK(gathered == bytes);
  // A view starting inside a unit has no byte address.
  CHECK_THROWS_AS(q.flatten().slice(0, 3, 70).raw_data(), std::invalid_argument);
}

TEST_CASE("nf4 save/load through safetensors keeps the bytes, dtype and shape") {
  Generator gen(9);
  const Tensor q = quantize_nf4(randn({5, 64}, gen));
  const Tensor q2 = quantize_nf4(randn({3, 37}, gen), no_dq());
  const std::string path =
      (std::filesystem::temp_directory_path() / "quanta_nf4_save_test.safetensors").string();
  io::save_safetensors(path, {{"w", q}, {"odd", q2}, {"plain", ones({2})}}, {{"k", "v"}});
  const io::SafetensorsFile f = io::load_safetensors(path);
  std::filesystem::remove(path);
  REQUIRE(f.tensors.size() == 3);
  CHECK(f.metadata == std::map<std::string, std::string>{{"k", "v"}});
  for (const auto& [name, t] : f.tensors) {
    if (name == "plain") continue;
    const Tensor& orig = name == "w" ? q : q2;
    CHECK(t.dtype() == DType::nf4);
    CHECK(t.shape() == orig.shape());
    CHECK(bytes_of(t) == bytes_of(orig));
  }
}

TEST_CASE("nf4 double quant: bitsandbytes export and import round trip") {
  Generator gen(13);
  const Tensor x = randn({300, 64}, gen);  // 300 blocks: one full, one partial group
  const Tensor q = quantize_nf4(x);        // double quant on by default
  // Exporting undoubled scales is exact; re-importing gives the same bytes.
  const Tensor plain = quantize_nf4(x, no_dq());
  CHECK(bytes_of(from_bnb(to_bnb(plain, false))) == bytes_of(plain));
  // Double quant: the stored scales are bitsandbytes' reconstruction.
  const BnbNF4State s = to_bnb(plain, true);
  CHECK(s.absmax.dtype() == DType::u8);
  CHECK(s.nested_absmax.numel() == 2);
  const Tensor plain_scales = nf4_unit_scales(plain);
  const DoubleQuantState dq = double_quantize(plain_scales.data<float>(), 300);
  const std::vector<float> rec = double_dequantize(dq);
  const Tensor imported = from_bnb(s);
  const Tensor s_imported = nf4_unit_scales(imported), s_q = nf4_unit_scales(q);
  const float* ps = s_imported.data<float>();
  const float* pq = s_q.data<float>();
  for (int b = 0; b < 300; ++b) {
    CHECK(ps[b] == rec[b]);
    CHECK(pq[b] == rec[b]);  // quantize_nf4 with double quant stores the same
  }
  CHECK(nf4_codes(imported).to_vector<int>() == nf4_codes(plain).to_vector<int>());
}

TEST_CASE("nf4 bitsandbytes and torchao layouts through safetensors files") {
  Generator gen(17);
  const Tensor x = randn({128, 128}, gen);
  const Tensor q = quantize_nf4(x, no_dq());
  io::TensorMap out;
  std::map<std::string, std::string> meta;
  append_bnb_tensors(out, "layer.weight", to_bnb(q, false));
  append_bnb_tensors(out, "dq.weight", to_bnb(q, true));
  append_torchao_tensors(out, meta, "ao.weight", to_torchao(q));
  const auto file = io::parse_safetensors(io::serialize_safetensors(out, meta));
  std::map<std::string, Tensor> t(file.tensors.begin(), file.tensors.end());
  CHECK(has_bnb_tensors(t, "layer.weight"));
  CHECK(!has_bnb_tensors(t, "ao.weight"));
  CHECK(bytes_of(from_bnb(read_bnb_tensors(t, "layer.weight"))) == bytes_of(q));
  const Tensor dq = from_bnb(read_bnb_tensors(t, "dq.weight"));
  CHECK(nf4_codes(dq).to_vector<int>() == nf4_codes(q).to_vector<int>());
  CHECK(max(abs(dequantize(dq) - dequantize(q))).item() < 0.02 * max(abs(x)).item());
  const TorchaoNF4State ao = read_torchao_tensors(t, file.metadata, "ao.weight");
  CHECK(nf4_codes(from_torchao(ao)).to_vector<int>() == nf4_codes(q).to_vector<int>());
  // torchao's 4-decimal table and int8 scalers stay close to ours.
  const double err = max(abs(torchao_dequantize(ao) - dequantize(q))).item();
  CHECK(err < 0.02 * max(abs(x)).item());
  CHECK_THROWS_WITH_AS(to_torchao(quantize_nf4(ones({64}))), doctest::Contains("16384"),
                       std::invalid_argument);
}

TEST_CASE("nf4 bitsandbytes and torchao readers refuse shapes whose sizes overflow") {
  // The shapes come from a file's JSON: multiplied out unchecked, [2^62, 4]
  // wrapped to 0 elements and matched an empty state.
  io::TensorMap out;
  append_bnb_tensors(out, "w", quantize_bnb(zeros({0, 4}), no_dq()));
  std::map<std::string, Tensor> t(out.begin(), out.end());
  const std::string json = R"({"quant_type":"nf4","blocksize":64,"dtype":"float32",)"
                           R"("shape":[4611686018427387904,4]})";
  t["w.quant_state.bitsandbytes__nf4"] =
      from_blob(json.data(), {static_cast<int64_t>(json.size())}, DType::u8, {.dtype = DType::u8});
  CHECK_THROWS_WITH_AS(read_bnb_tensors(t, "w"),
                       "[read_bnb_tensors] 'w.quant_state.bitsandbytes__nf4': shape "
                       "[4611686018427387904, 4] has a negative size or overflows 64-bit sizes",
                       std::invalid_argument);

  io::TensorMap ao;
  std::map<std::string, std::string> meta;
  Generator gen(21);
  append_torchao_tensors(ao, meta, "a", to_torchao(quantize_nf4(randn({128, 128}, gen))));
  meta["a.torchao_nf4"] = R"({"shape":[9223372036854775807,2],"block_size":64,)"
                          R"("scaler_block_size":256})";
  CHECK_THROWS_WITH_AS(read_torchao_tensors({ao.begin(), ao.end()}, meta, "a"),
                       doctest::Contains("overflows 64-bit sizes"), std::invalid_argument);
}

TEST_CASE("nf4 dequantize_into writes the same values into a reused buffer") {
  Generator gen(19);
  const Tensor q = quantize_nf4(randn({7, 100}, gen));
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor out = zeros({7, 100}, {.dtype = dt});
    dequantize_into(q, out);
    CHECK(out.to_vector<float>() == dequantize(q, dt).to_vector<float>());
  }
  CHECK_THROWS_WITH_AS(dequantize_into(q, zeros({7, 99})), doctest::Contains("shape"),
                       std::invalid_argument);
}

TEST_CASE("nf4 torchao export of constant scales stays finite") {
  // Every block has absmax 1: all scalers equal their mean.
  const Tensor q = quantize_nf4(ones({128, 128}), no_dq());
  const TorchaoNF4State s = to_torchao(q);
  CHECK(max(abs(torchao_dequantize(s) - ones({128, 128}))).item() == 0.0);
}
