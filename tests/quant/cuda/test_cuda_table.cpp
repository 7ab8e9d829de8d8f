// The CUDA quantizer table (quant/cuda/): every entry on cuda:0 against the
// CPU table on the same inputs (indices and NF4 bytes equal, values within
// each dtype's tolerance), skipped with one line where no GPU is present.
// The math it shares with the CPU and its plans are checked without a GPU
// (tests/quant/kernels/test_functors.cpp, tests/quant/cuda/test_plans.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "quant/cuda/plans.h"
#include "quant/kernels/entropy_walk.h"
#include "quant/kernels/functors.h"
#include "quant/kernels/table.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quant/nf4/nf4_linear.h"
#include "quanta.h"
#include "support/gpu.h"
#include "support/quant_table_checks.h"

using namespace quanta;
using namespace quanta::quant;
using namespace quanta::testing;
namespace qfn = quanta::quant::fn;

namespace {

using testing::have_gpu;

Tensor on_gpu(const Tensor& t) { return t.contiguous().to(Device::cuda(0)); }

// Either side may be on the GPU (runs of the same kernel are compared too).
bool same_bytes(const Tensor& got, const Tensor& want) {
  const Tensor a = got.to(Device::cpu()).contiguous(), b = want.to(Device::cpu()).contiguous();
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

double tol(DType t) { return t == DType::f64 ? 1e-10 : 2e-5; }

const QuantKernelTable& gpu_t() { return quant_kernels(Device::cuda(0)); }

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
  cpu_quant_table().nf4_absmax(x.data<float>(), n, 64, absmax.data<float>());
  const NF4RunsOut out{.run = 64,
                       .codes = units.data<uint8_t>(),
                       .code_stride = static_cast<int64_t>(kNF4UnitBytes),
                       .pad_runs = true,
                       .scales = units.data<uint8_t>() + kNF4CodeBytes,
                       .scale_stride = static_cast<int64_t>(kNF4UnitBytes)};
  cpu_quant_table().nf4_encode(x.data<float>(), n, 64, absmax.data<float>(), absmax.data<float>(),
                               out);
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
        cpu_quant_table().nearest_codes(dt, x.raw_data(), c.raw_data(), n, 2 * k, d, cosine,
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
  cpu_quant_table().nearest_codes(DType::f32, x.raw_data(), c.raw_data(), n, k, d, false,
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
      cpu_quant_table().squared_error(dt, x.raw_data(), q.raw_data(), hv, rows, d,
                                      want.data<double>());
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
      cpu_quant_table().squared_error_grad(dt, x.raw_data(), q.raw_data(), hv, rows, d,
                                           scale.data<double>(), gwant.raw_data());
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
        cpu_quant_table().route_grad(rotation, dt, x.raw_data(), q.raw_data(), g.raw_data(),
                                     masked ? valid.data<uint8_t>() : nullptr, coef.data<double>(),
                                     rows, d, want.raw_data());
        gpu_t().route_grad(rotation, dt, on_gpu(x).raw_data(), on_gpu(q).raw_data(),
                           on_gpu(g).raw_data(), masked ? testing::dev<uint8_t>(gvalid) : nullptr,
                           testing::dev<double>(gcoef), rows, d, got.raw_data());
        INFO(dtype_name(dt), " rotation ", rotation, " masked ", masked);
        CHECK(max_err(got, want) <= 10 * tol(dt));
      }
}

TEST_CASE("quant cuda: dead-code picks and replacements write the CPU's values") {
  SKIP_WITHOUT_GPU();
  // 2500 codes: runs of three codes a thread in the scan's one block.
  for (DType dt : {DType::f32, DType::f64})
    for (const int64_t k : {int64_t{7}, int64_t{2500}}) {
      const int64_t d = 5, pool = k + 3;
      Tensor sizes = abs(random_tensor({k}, dt, 12)) * 2.0;
      Generator gen(0x5eed);
      Tensor draws = randperm_prefix(pool, k, gen);
      Tensor picks = empty({k}, {.dtype = DType::i64});
      Tensor gpicks = empty({k}, {.dtype = DType::i64, .device = Device::cuda(0)});
      cpu_quant_table().dead_code_picks(dt, sizes.raw_data(), k, 1.0, draws.data<int64_t>(),
                                        picks.data<int64_t>());
      gpu_t().dead_code_picks(dt, on_gpu(sizes).raw_data(), k, 1.0,
                              testing::dev<int64_t>(on_gpu(draws)), testing::dev<int64_t>(gpicks));
      CHECK(same_bytes(gpicks, picks));
      for (bool gather : {true, false}) {
        Tensor src = random_tensor({pool, d}, dt, 13);
        Tensor embed = random_tensor({k, d}, dt, 14), avg = random_tensor({k, d}, dt, 15);
        Tensor size = sizes.clone();
        Tensor gembed = on_gpu(embed), gavg = on_gpu(avg), gsize = on_gpu(size);
        cpu_quant_table().replace_codes(dt, k, d, picks.data<int64_t>(), gather, src.raw_data(),
                                        1.0, embed.raw_data(), avg.raw_data(), size.raw_data());
        gpu_t().replace_codes(dt, k, d, testing::dev<int64_t>(gpicks), gather,
                              on_gpu(src).raw_data(), 1.0, gembed.raw_data(), gavg.raw_data(),
                              gsize.raw_data());
        CHECK(same_bytes(gembed, embed));
        CHECK(same_bytes(gavg, avg));
        CHECK(same_bytes(gsize, size));
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
      cpu_quant_table().code_statistics(dt, idx.data<int64_t>(), x.raw_data(), c.n, c.k, c.d,
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
      cpu_quant_table().bit_product(dt, pi.raw_data(), rows, k, want.raw_data());
      gpu_t().bit_product(dt, on_gpu(pi).raw_data(), rows, k, got.raw_data());
      INFO(dtype_name(dt), " k ", k);
      CHECK(same_bytes(got, want));  // the same multiplications in the same order
      Tensor gwant = zeros({rows, k, 2}, {.dtype = dt});
      Tensor ggot = zeros({rows, k, 2}, {.dtype = dt, .device = Device::cuda(0)});
      cpu_quant_table().bit_product_grad(dt, pi.raw_data(), go.raw_data(), rows, k,
                                         gwant.raw_data());
      gpu_t().bit_product_grad(dt, on_gpu(pi).raw_data(), on_gpu(go).raw_data(), rows, k,
                               ggot.raw_data());
      CHECK(max_err(ggot, gwant) <= tol(dt));
    }
  // The bit probabilities of a column range and their gradient into those
  // columns only (the device's exp: within rounding of the CPU's).
  for (DType dt : {DType::f32, DType::f64}) {
    const int64_t rows = 9, d = 7, begin = 3, k = 4;
    Tensor z = random_tensor({rows, d}, dt, 16) * 8.0;
    Tensor g = random_tensor({rows, k, 2}, dt, 17);
    Tensor want = empty({rows, k, 2}, {.dtype = dt});
    Tensor got = empty({rows, k, 2}, {.dtype = dt, .device = Device::cuda(0)});
    cpu_quant_table().bit_probabilities(dt, z.raw_data(), rows, d, begin, k, want.raw_data());
    gpu_t().bit_probabilities(dt, on_gpu(z).raw_data(), rows, d, begin, k, got.raw_data());
    INFO(dtype_name(dt));
    CHECK(max_err(got, want) <= tol(dt));
    Tensor dwant = full({rows, d}, 5.0, {.dtype = dt});
    Tensor dgot = on_gpu(dwant);
    cpu_quant_table().bit_probabilities_grad(dt, z.raw_data(), g.raw_data(), rows, d, begin, k,
                                             dwant.raw_data());
    gpu_t().bit_probabilities_grad(dt, on_gpu(z).raw_data(), on_gpu(g).raw_data(), rows, d, begin,
                                   k, dgot.raw_data());
    CHECK(max_err(dgot, dwant) <= tol(dt));
    CHECK(max_err(slice(dgot, 1, 0, begin), full({rows, begin}, 5.0, {.dtype = dt})) == 0.0);
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
      cpu_quant_table().clamped_entropy(z.data<double>(), rows, d, h.data<double>(),
                                        g.data<double>());
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
    cpu_quant_table().nf4_absmax(x.data<float>(), n, block, absmax.data<float>());
    gpu_t().nf4_absmax(testing::dev<float>(gx), n, block, testing::dev<float>(gabs));
    REQUIRE(same_bytes(gabs, absmax));
    // bitsandbytes' layout: packed codes, scales apart.
    Tensor packed = zeros({(n + 1) / 2}, {.dtype = DType::u8});
    Tensor gpacked = zeros({(n + 1) / 2}, {.dtype = DType::u8, .device = Device::cuda(0)});
    cpu_quant_table().nf4_encode(
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
      cpu_quant_table().nf4_decode(w, dt, want.raw_data());
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
        cpu_quant_table().nf4_decode(w, dt, want.raw_data());
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
        // bf16 products round the activation to bf16 first (plans.h): the CPU
        // is given it rounded, so its f32 products (a host without bf16 ones)
        // and its bf16 products both give the GPU's values within f32 sums.
        const bool bf16 = quant_cuda::nf4_bf16_products(dt == DType::f32, dd, s.m);
        const auto as_bf16 = [&](const Tensor& t) {
          return bf16 ? t.to(DType::bf16).to(DType::f32) : t;
        };
        cpu_quant_table().nf4_linear(dt, as_bf16(x).raw_data(), s.m, s.k, w, dd, s.n,
                                     bias.raw_data(), want.raw_data(), {});
        gpu_t().nf4_linear(dt, on_gpu(x).raw_data(), s.m, s.k, gw, dd, s.n, on_gpu(bias).raw_data(),
                           got.raw_data(), {});
        CHECK(max_err(got, want) <= 10 * tol(dt));
        Tensor g = random_tensor({s.m, s.n}, dt, 21);
        Tensor dwant = empty({s.m, s.k}, {.dtype = dt});
        Tensor dgot = empty({s.m, s.k}, {.dtype = dt, .device = Device::cuda(0)});
        cpu_quant_table().nf4_linear_grad(dt, as_bf16(g).raw_data(), s.m, s.n, w, dd, s.k,
                                          dwant.raw_data(), false);
        gpu_t().nf4_linear_grad(dt, on_gpu(g).raw_data(), s.m, s.n, gw, dd, s.k, dgot.raw_data(),
                                false);
        CHECK(max_err(dgot, dwant) <= 10 * tol(dt));
        // Accumulating: the product added onto what dx holds.
        gpu_t().nf4_linear_grad(dt, on_gpu(g).raw_data(), s.m, s.n, gw, dd, s.k, dgot.raw_data(),
                                true);
        CHECK(max_err(dgot, dwant * 2.0) <= 20 * tol(dt));
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
  // staged x (8192), whole groups of steps then single ones (1344 = 5.25
  // steps; one row of x has kernels of its own, bounded to 64 registers); n:
  // not a multiple of a block's 16 rows, 1, many blocks.
  const Case cases[] = {{1, 64, 1, 64, true},
                        {1, 320, 17, 64, true},
                        {1, 8192, 33, 64, true},
                        {1, 1344, 40, 64, false},
                        {2, 8192, 33, 64, true},
                        {3, 4096, 1100, 64, true},
                        {8, 320, 70, 64, true},
                        {5, 96, 9, 32, false},
                        {4, 512, 40, 128, false},
                        {7, 768, 19, 256, false},
                        {kNF4GemvMaxBatch, 1024, 257, 64, false},
                        // One row over each fixed walk (plans.h: NF4GemvWalk), and
                        // blocks of 512, which have none.
                        {1, 96, 9, 32, false},
                        {1, 1280, 40, 128, false},
                        {1, 768, 19, 256, false},
                        {1, 1024, 20, 512, false}};
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
      cpu_quant_table().nf4_absmax(wf.data<float>(), n, c.block, scales.data<float>());
      cpu_quant_table().nf4_encode(
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
    // Each kernel (plans.h: NF4GemvKind), chosen as a benchmark chooses
    // (`fixed` runs as unstaged past one f32 row or with no fixed walk).
    for (const char* kind : {"staged", "unstaged", "fixed"})
      for (DType dt : {DType::f32, DType::f64})
        for (DType dd : {DType::f32, DType::bf16, DType::f16})
          for (bool with_bias : {false, true}) {
            INFO(kind, " ", c.m, "x", c.k, "x", c.n, " block ", c.block,
                 c.units ? " units " : " packed ", dtype_name(dt), " dequant ", dtype_name(dd),
                 with_bias ? " bias" : "");
            setenv("QUANTA_NF4_GEMV", kind, 1);
            const int64_t mt = kNF4GemvMaxBatch + 1;  // rows for the tiled path
            // Where the tiled path multiplies in bf16 it rounds x to bf16 first
            // (plans.h: nf4_bf16_products): x is given already rounded, so the
            // GEMV, which does not round it, sees the same values.
            Tensor xt = random_tensor({mt, c.k}, dt, 32);
            if (quant_cuda::nf4_bf16_products(dt == DType::f32, dd, mt))
              xt = xt.to(DType::bf16).to(DType::f32);
            const Tensor x = slice(xt, 0, 0, c.m).contiguous();
            const Tensor bias = with_bias ? random_tensor({c.n}, dt, 33) : Tensor();
            const Tensor gbias = with_bias ? on_gpu(bias) : Tensor();
            const void* b = with_bias ? bias.raw_data() : nullptr;
            const void* gb = with_bias ? gbias.raw_data() : nullptr;
            Tensor want = empty({c.m, c.n}, {.dtype = dt});
            Tensor got = empty({c.m, c.n}, {.dtype = dt, .device = Device::cuda(0)});
            Tensor tiled = empty({mt, c.n}, {.dtype = dt, .device = Device::cuda(0)});
            cpu_quant_table().nf4_linear(dt, x.raw_data(), c.m, c.k, w, dd, c.n, b, want.raw_data(),
                                         {});
            gpu_t().nf4_linear(dt, on_gpu(x).raw_data(), c.m, c.k, gw, dd, c.n, gb, got.raw_data(),
                               {});
            gpu_t().nf4_linear(dt, on_gpu(xt).raw_data(), mt, c.k, gw, dd, c.n, gb,
                               tiled.raw_data(), {});
            CHECK(max_err(got, want) <= 10 * tol(dt));
            CHECK(max_err(got, slice(tiled.to(Device::cpu()), 0, 0, c.m)) <= 10 * tol(dt));
            unsetenv("QUANTA_NF4_GEMV");
          }
    // The fixed kernel sums as the unstaged one does: the same bits.
    if (c.m == 1)
      for (DType dd : {DType::f32, DType::bf16, DType::f16}) {
        INFO("fixed against unstaged, k ", c.k, " n ", c.n, " dequant ", dtype_name(dd));
        const Tensor x = on_gpu(random_tensor({1, c.k}, DType::f32, 34));
        Tensor ys[2];
        const char* kinds[2] = {"unstaged", "fixed"};
        for (int i = 0; i < 2; ++i) {
          setenv("QUANTA_NF4_GEMV", kinds[i], 1);
          ys[i] = empty({1, c.n}, {.device = Device::cuda(0)});
          gpu_t().nf4_linear(DType::f32, x.raw_data(), 1, c.k, gw, dd, c.n, nullptr,
                             ys[i].raw_data(), {});
        }
        unsetenv("QUANTA_NF4_GEMV");
        CHECK(max_err(ys[0].to(Device::cpu()), ys[1].to(Device::cpu())) == 0.0);
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
  t.dead_code_picks(DType::f32, nullptr, 0, 1.0, nullptr, nullptr);
  t.replace_codes(DType::f32, 0, 4, nullptr, true, nullptr, 1.0, nullptr, nullptr, nullptr);
  t.bit_probabilities(DType::f32, nullptr, 0, 4, 0, 2, nullptr);
  t.bit_probabilities_grad(DType::f32, nullptr, nullptr, 0, 4, 0, 2, nullptr);
  t.bit_product(DType::f32, nullptr, 0, 3, nullptr);
  t.clamped_entropy(nullptr, 0, 3, nullptr, nullptr);
  t.nf4_decode(NF4Runs{}, DType::f32, nullptr);
  t.nf4_linear(DType::f32, nullptr, 0, 64, NF4Runs{}, DType::f32, 4, nullptr, nullptr, {});
  t.nf4_linear_grad(DType::f32, nullptr, 0, 4, NF4Runs{}, DType::f32, 64, nullptr, false);
}
