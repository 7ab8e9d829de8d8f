// MixedPrecision (engine/precision.h): f32 products from bf16-rounded
// operands with f32 sums, the precision each backward node inherits from its
// forward, and the products that stay f32 (f64, sq_dist). The cases whose
// names say "bf16 products" also run with QUANTA_CPU_BF16_GEMM=1 (the
// bf16_products_forced test), so CPUs without bf16 instructions check them.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/cpu/conv_direct.h"
#include "engine/cpu/conv_onednn.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/kernels.h"
#include "quanta.h"
#include "support/bf16_products.h"
#include "support/gpu.h"
#include "support/main_job_conv.h"
#include "support/relative_error.h"

using namespace quanta;
using quanta::testing::bf16_products_or_skip;
using quanta::testing::max_rel_diff;

namespace {

// `x` rounded to bf16 and widened back to f64: the operand a bf16 product sees.
Tensor bf16_rounded(const Tensor& x) { return x.detach().to(DType::bf16).to(DType::f64); }

// Products of at least 2^20 multiply-adds, which the CPU takes in bf16.
constexpr int64_t kRows = 64, kIn = 256, kOut = 128;

}  // namespace

TEST_CASE("MixedPrecision: guards nest and restore") {
  CHECK_FALSE(mixed_precision_enabled());
  {
    const MixedPrecision on;
    CHECK(mixed_precision_enabled());
    {
      const MixedPrecision off(false);
      CHECK_FALSE(mixed_precision_enabled());
    }
    CHECK(mixed_precision_enabled());
  }
  CHECK_FALSE(mixed_precision_enabled());
}

TEST_CASE("MixedPrecision: bf16 products in linear, matmul and their backward") {
  if (!bf16_products_or_skip("bf16_products_forced")) return;
  Generator gen(11);
  const Tensor x = randn({kRows, kIn}, gen).requires_grad_(true);
  const Tensor w = randn({kOut, kIn}, gen).requires_grad_(true);
  const Tensor g = randn({kRows, kOut}, gen);
  const Tensor exact = linear(x.detach(), w.detach());

  Tensor y;
  {
    const MixedPrecision mixed;
    y = linear(x, w);
  }
  // The product of the rounded operands, summed in f32: within f32 rounding
  // of the f64 product of the same operands, and visibly not the f32 one.
  const Tensor want = linear(bf16_rounded(x), bf16_rounded(w));
  CHECK(max_rel_diff(y, want) < 1e-5);
  CHECK(max_rel_diff(y, exact) > 1e-4);
  CHECK(max_rel_diff(y, exact) < 2e-2);
  CHECK(y.dtype() == DType::f32);

  // The backward runs after the guard ended, in the forward's precision.
  y.backward(g);
  CHECK(max_rel_diff(x.grad(), matmul(bf16_rounded(g), bf16_rounded(w))) < 1e-5);
  CHECK(max_rel_diff(w.grad(), matmul(transpose(bf16_rounded(g), 0, 1), bf16_rounded(x))) < 1e-5);

  // A product made outside the guard is differentiated in f32 even when its
  // backward runs inside one.
  x.zero_grad();
  const Tensor y32 = matmul(x, transpose(w.detach(), 0, 1));
  CHECK(max_rel_diff(y32, exact) < 1e-6);
  {
    const MixedPrecision mixed;
    y32.backward(g);
  }
  CHECK(max_rel_diff(x.grad(), matmul(g.to(DType::f64), w.detach().to(DType::f64))) < 1e-6);

  // matmul with batch dims (one GEMM per batch entry) under the guard.
  const Tensor a = randn({3, kRows, kIn}, gen), b = randn({3, kIn, kOut}, gen);
  Tensor ab;
  {
    const MixedPrecision mixed;
    ab = matmul(a, b);
  }
  CHECK(max_rel_diff(ab, matmul(bf16_rounded(a), bf16_rounded(b))) < 1e-5);
  CHECK(max_rel_diff(ab, matmul(a, b)) > 1e-4);
}

TEST_CASE("MixedPrecision: bf16 products in conv2d (im2col path) and its backward") {
  if (!bf16_products_or_skip("bf16_products_forced")) return;
  // The direct AVX-512 kernels multiply in f32 whatever the precision; off,
  // and oneDNN's kernels off (the case below), the convolution goes through
  // im2col and the GEMM.
  cpu::conv_direct_enable(false);
  const bool onednn_was_on = cpu::conv_onednn_enable(false);
  Generator gen(12);
  const Tensor x = randn({8, 32, 16, 16}, gen).requires_grad_(true);
  const Tensor w = randn({64, 32, 3, 3}, gen).requires_grad_(true);
  const Tensor g = randn({8, 64, 16, 16}, gen);
  for (const ConvLayout layout : {ConvLayout::nchw, ConvLayout::nhwc}) {
    CAPTURE(layout == ConvLayout::nhwc);
    const auto in = [&](const Tensor& t) {
      return layout == ConvLayout::nhwc ? permute(t, {0, 2, 3, 1}).contiguous() : t;
    };
    const Tensor xl = in(x.detach()).requires_grad_(true), gl = in(g);
    Tensor y;
    {
      const MixedPrecision mixed;
      y = conv2d(xl, w, Tensor(), {1, 1}, {1, 1}, {1, 1}, 1, layout);
    }
    const Tensor want =
        conv2d(bf16_rounded(xl), bf16_rounded(w), Tensor(), {1, 1}, {1, 1}, {1, 1}, 1, layout);
    CHECK(max_rel_diff(y, want) < 1e-5);
    CHECK(max_rel_diff(y, conv2d(xl.detach(), w.detach(), Tensor(), {1, 1}, {1, 1}, {1, 1}, 1,
                                 layout)) > 1e-4);
    w.zero_grad();
    y.backward(gl);
    const Tensor gx = conv_transpose2d(bf16_rounded(gl), bf16_rounded(w), Tensor(), {1, 1}, {1, 1},
                                       {0, 0}, 1, {1, 1}, layout);
    CHECK(max_rel_diff(xl.grad(), gx) < 1e-5);
    // The weight gradient sums over every pixel of every image: f32 sums of
    // bf16 products against f64 sums.
    const Tensor xd = bf16_rounded(xl).requires_grad_(true);
    const Tensor wd = bf16_rounded(w).requires_grad_(true);
    conv2d(xd, wd, Tensor(), {1, 1}, {1, 1}, {1, 1}, 1, layout).backward(bf16_rounded(gl));
    CHECK(max_rel_diff(w.grad(), wd.grad()) < 1e-4);
  }
  cpu::conv_direct_enable(true);
  cpu::conv_onednn_enable(onednn_was_on);
}

TEST_CASE("MixedPrecision: bf16 products in oneDNN's conv2d, forward and input gradient") {
  if (!bf16_products_or_skip("bf16_products_forced")) return;
  // enc2 of the main job at batch 64 (51M multiply-adds): its forward and
  // input gradient multiply bf16-rounded operands; its weight gradient, and
  // the 1x1 layer below (1.6M), stay f32 (engine/cpu/conv_onednn.cpp).
  const ConvGeom enc2 = quanta::testing::main_job_enc2(true);
  if (cpu::conv_onednn_kernel(ConvKind::forward, enc2).find("bf16") == std::string::npos) {
    MESSAGE(
        "skipped: oneDNN has no bf16 convolution kernel for this CPU (or this build has no "
        "oneDNN): MixedPrecision convolutions multiply in f32 here");
    return;
  }
  CHECK(cpu::conv_onednn_kernel(ConvKind::input_grad, enc2).find("bf16") != std::string::npos);
  CHECK(cpu::conv_onednn_kernel(ConvKind::weight_grad, enc2).find("bf16") == std::string::npos);
  Generator gen(13);
  const ConvLayout nhwc = ConvLayout::nhwc;
  const Tensor x = randn({64, 14, 14, 32}, gen);
  const Tensor w = randn({32, 32, 4, 4}, gen).requires_grad_(true);
  const Tensor g = randn({64, 7, 7, 32}, gen);
  const Tensor xl = x.detach().requires_grad_(true);
  Tensor y;
  {
    const MixedPrecision mixed;
    y = conv2d(xl, w, Tensor(), {2, 2}, {1, 1}, {1, 1}, 1, nhwc);
  }
  const Tensor want =
      conv2d(bf16_rounded(x), bf16_rounded(w), Tensor(), {2, 2}, {1, 1}, {1, 1}, 1, nhwc);
  CHECK(max_rel_diff(y, want) < 1e-5);
  CHECK(max_rel_diff(y, conv2d(x, w.detach(), Tensor(), {2, 2}, {1, 1}, {1, 1}, 1, nhwc)) > 1e-4);
  y.backward(g);
  const Tensor gx = conv_transpose2d(bf16_rounded(g), bf16_rounded(w), Tensor(), {2, 2}, {1, 1},
                                     {0, 0}, 1, {1, 1}, nhwc);
  CHECK(max_rel_diff(xl.grad(), gx) < 1e-5);
  // The weight gradient in f32, as without MixedPrecision: the same bits.
  const Tensor xf = x.detach(), wf = w.detach().requires_grad_(true);
  conv2d(xf, wf, Tensor(), {2, 2}, {1, 1}, {1, 1}, 1, nhwc).backward(g);
  CHECK(max_rel_diff(w.grad(), wf.grad()) == 0.0);

  // The 1x1 layer: f32 products, the bits of an f32 run.
  const Tensor x4 = randn({64, 7, 7, 32}, gen), w4 = randn({16, 32, 1, 1}, gen);
  Tensor y4;
  {
    const MixedPrecision mixed;
    y4 = conv2d(x4, w4, Tensor(), {1, 1}, {0, 0}, {1, 1}, 1, nhwc);
  }
  CHECK(max_rel_diff(y4, conv2d(x4, w4, Tensor(), {1, 1}, {0, 0}, {1, 1}, 1, nhwc)) == 0.0);
}

TEST_CASE("MixedPrecision: f64 products and sq_dist stay exact; small products stay f32") {
  Generator gen(13);
  const Tensor x = randn({kRows, kIn}, gen, {.dtype = DType::f64});
  const Tensor w = randn({kOut, kIn}, gen, {.dtype = DType::f64});
  const Tensor c = randn({kOut, kIn}, gen);
  const Tensor x32 = x.to(DType::f32);
  const Tensor small_a = randn({8, 16}, gen), small_b = randn({16, 8}, gen);
  const Tensor ref64 = linear(x, w), ref_dist = sq_dist(x32, c);
  const Tensor ref_small = matmul(small_a, small_b);
  const MixedPrecision mixed;
  CHECK(linear(x, w).to_vector<double>() == ref64.to_vector<double>());
  // Distances decide codes: the quantizers' nearest-code search keeps f32.
  CHECK(sq_dist(x32, c).to_vector<float>() == ref_dist.to_vector<float>());
  CHECK(matmul(small_a, small_b).to_vector<float>() == ref_small.to_vector<float>());
}

TEST_CASE("MixedPrecision on sim: bf16 products, the CPU's bits") {
  if (!bf16_products_or_skip("bf16_products_forced")) return;
  Generator gen(14);
  const Tensor x = randn({kRows, kIn}, gen).requires_grad_(true);
  const Tensor w = randn({kOut, kIn}, gen).requires_grad_(true);
  const Tensor xs = x.detach().to(Device::sim(0)).requires_grad_(true);
  const Tensor ws = w.detach().to(Device::sim(0)).requires_grad_(true);
  Tensor y, ys;
  {
    const MixedPrecision mixed;
    y = linear(x, w);
    ys = linear(xs, ws);
  }
  CHECK(ys.to(Device::cpu()).to_vector<float>() == y.to_vector<float>());
  sum(y).backward();
  sum(ys).backward();
  CHECK(xs.grad().to(Device::cpu()).to_vector<float>() == x.grad().to_vector<float>());
  CHECK(ws.grad().to(Device::cpu()).to_vector<float>() == w.grad().to_vector<float>());
}

TEST_CASE("MixedPrecision on cuda:0: bf16 tensor-core GEMMs and TF32 convolutions") {
  if (!quanta::testing::have_gpu()) {
    MESSAGE("skipped: " << quanta::testing::no_gpu_reason());
    return;
  }
  Generator gen(15);
  const Device gpu = Device::cuda(0);
  const Tensor x = randn({kRows, kIn}, gen), w = randn({kOut, kIn}, gen);
  const Tensor xc = randn({8, 32, 16, 16}, gen), wc = randn({64, 32, 3, 3}, gen);
  Tensor y, yc;
  {
    const MixedPrecision mixed;
    y = linear(x.to(gpu), w.to(gpu)).to(Device::cpu());
    yc = conv2d(xc.to(gpu), wc.to(gpu), Tensor(), {1, 1}, {1, 1}).to(Device::cpu());
  }
  // CUBLAS_COMPUTE_32F_FAST_16BF allows cuBLAS to round the operands to bf16
  // for the tensor cores and sum in f32 (its order, not the CPU's); it does
  // not say how it rounds. On data like this (256 terms of random sign) the
  // bf16-operand product is 2-3e-3 of the largest output from the exact one
  // when rounding to nearest, and truncating operands land 8.4e-3 from it:
  // held to that, both distances printed so the run records which it got
  // (about 1e-7 from the first: rounding to nearest, as the CPU does).
  const Tensor rounded = linear(bf16_rounded(x), bf16_rounded(w)), plain = linear(x, w);
  MESSAGE("cuda:0 MixedPrecision linear: max relative distance to the bf16-operand product "
          << max_rel_diff(y, rounded) << ", to the f32 product " << max_rel_diff(y, plain));
  CHECK(max_rel_diff(y, rounded) < 1.2e-2);
  CHECK(max_rel_diff(y, plain) < 1.5e-2);
  CHECK_MESSAGE(max_rel_diff(y, plain) > 1e-5,
                "the product under MixedPrecision is the f32 one: no bf16 arithmetic ran");
  const Tensor exact_c = conv2d(xc.to(DType::f64), wc.to(DType::f64), Tensor(), {1, 1}, {1, 1});
  CHECK(max_rel_diff(yc, exact_c) < 2e-3);
}

TEST_CASE("CPU bf16 rule: bf16 products where they beat f32 ones, AMX or AMD's AVX512_BF16") {
  using cpu::CpuBf16Kind;
  // {bf16_dot, amx, amd}
  CHECK(cpu::bf16_products_pay(CpuBf16Kind{true, true, false}));          // Intel with AMX
  CHECK(cpu::bf16_products_pay(CpuBf16Kind{true, false, true}));          // Zen 4, Zen 5
  CHECK(cpu::bf16_products_pay(CpuBf16Kind{true, true, true}));           // AMD with AMX
  CHECK_FALSE(cpu::bf16_products_pay(CpuBf16Kind{true, false, false}));   // AMX hidden
  CHECK_FALSE(cpu::bf16_products_pay(CpuBf16Kind{false, false, true}));   // Zen 3
  CHECK_FALSE(cpu::bf16_products_pay(CpuBf16Kind{false, false, false}));  // no AVX512_BF16
  // This process's answer follows the rule on this CPU, unless the
  // environment or the build decides (the reason says which).
  const std::string reason = cpu::bf16_gemm_reason();
  CAPTURE(reason);
  CHECK(reason.rfind(cpu::bf16_gemm_native() ? "on: " : "off: ", 0) == 0);
  const bool cpu_decides = reason.find("QUANTA_CPU_BF16_GEMM") == std::string::npos &&
                           reason.find("oneDNN") == std::string::npos;
  if (cpu_decides)
    CHECK(cpu::bf16_gemm_native() == cpu::bf16_products_pay(cpu::this_cpu_bf16_kind()));
}

TEST_CASE("bf16 products: bf16 matmul and linear on the CPU multiply bf16 directly") {
  CHECK(cpu::cpu_kernels().gemm_bf16 == cpu::bf16_gemm_native());
  CHECK_FALSE(cpu::cpu_kernels().gemm_f16);
  if (!bf16_products_or_skip("bf16_products_forced")) return;
  // Large products go to oneDNN's bf16 matmul, small ones widen in the
  // kernel; either way f32 sums of exact products rounded once to bf16: the
  // widened f64 product rounded to bf16, up to the last bit.
  Generator gen(16);
  for (const int64_t rows : {int64_t{kRows}, int64_t{3}}) {
    CAPTURE(rows);
    const Tensor x = randn({rows, kIn}, gen).to(DType::bf16).requires_grad_(true);
    const Tensor w = randn({kOut, kIn}, gen).to(DType::bf16).requires_grad_(true);
    const Tensor b = randn({kOut}, gen).to(DType::bf16);
    const Tensor y = linear(x, w, b);
    CHECK(y.dtype() == DType::bf16);
    const Tensor want =
        linear(x.detach().to(DType::f64), w.detach().to(DType::f64), b.to(DType::f64));
    CHECK(max_rel_diff(y.to(DType::f64), want) < 1.0 / 128);
    const Tensor g = randn({rows, kOut}, gen).to(DType::bf16);
    y.backward(g);
    CHECK(x.grad().dtype() == DType::bf16);
    CHECK(max_rel_diff(x.grad().to(DType::f64),
                       matmul(g.to(DType::f64), w.detach().to(DType::f64))) < 1.0 / 128);
    CHECK(max_rel_diff(w.grad().to(DType::f64), matmul(transpose(g.to(DType::f64), 0, 1),
                                                       x.detach().to(DType::f64))) < 1.0 / 128);
  }
  // A batch of products, one per batch entry.
  const Tensor a = randn({3, kRows, kIn}, gen).to(DType::bf16);
  const Tensor c = randn({3, kIn, kOut}, gen).to(DType::bf16);
  CHECK(max_rel_diff(matmul(a, c).to(DType::f64), matmul(a.to(DType::f64), c.to(DType::f64))) <
        1.0 / 128);
}
