// nf4_linear against dequantize-then-linear (nf4 dtype and bitsandbytes'
// layout, block 32 included, every dequant dtype, fused, tiled and multi-tile
// paths), its f64 gradient, and the NF4Linear / LoRALinear modules (state
// dicts, merge, a LoRA training run).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "quant/cpu/kernels.h"
#include "quant/kernels/nf4_layout.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_linear.h"
#include "quant/nf4/nf4_modules.h"
#include "quanta.h"
#include "support/gpu.h"
#include "support/numeric_grad.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::numeric_grad;

namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(DType::f64) - b.to(DType::f64))).item();
}

// Whether an f32 nf4_linear of m rows with weights in `dt` computes in bf16,
// rounding its input (or output gradient) to bf16 too: on every CPU, by bf16
// products or by f32 products of the bf16 values.
bool rounds_input(DType dt, int64_t m) { return dt == DType::bf16 && m > kNF4FusedMaxBatch; }

}  // namespace

TEST_CASE("nf4_linear forward equals dequantize-then-linear on every path") {
  Generator gen(21);
  struct Shape3 {
    int64_t m, k, n;
  };
  // Fused small batch (k % 64 == 0), tiled GEMM, k not a multiple of 64,
  // leading batch dims, tiles smaller than the weight.
  for (Shape3 s : {Shape3{1, 128, 40}, Shape3{8, 192, 33}, Shape3{9, 128, 40}, Shape3{20, 100, 7},
                   Shape3{3, 37, 5}, Shape3{64, 4096, 80}}) {
    CAPTURE(s.m);
    CAPTURE(s.k);
    const Tensor w = randn({s.n, s.k}, gen);
    const Tensor q = quantize_nf4(w);
    const Tensor b = randn({s.n}, gen);
    const Tensor x = randn({s.m, s.k}, gen);
    const Tensor ref = linear(x.to(DType::f64), dequantize(q).to(DType::f64), b.to(DType::f64));
    const Tensor y = nf4_linear(x, q, b);
    CHECK(y.shape() == Shape{s.m, s.n});
    CHECK(max_abs_diff(y, ref) < 1e-4 * std::sqrt(double(s.k)));
    // f64 input: the same values up to rounding of the f64 products.
    CHECK(max_abs_diff(nf4_linear(x.to(DType::f64), q, b.to(DType::f64)), ref) < 1e-10);
  }
  // [B, T, in] inputs keep their leading dims.
  const Tensor q = quantize_nf4(randn({6, 64}, gen));
  CHECK(nf4_linear(randn({2, 3, 64}, gen), q).shape() == Shape{2, 3, 6});
}

TEST_CASE("nf4_linear with block-32 weights (bitsandbytes' layout) on every path") {
  Generator gen(22);
  struct Shape3 {
    int64_t m, k, n;
  };
  // Fused with rows of whole 32-element runs (96 % 64 != 0), tiled, k not a
  // multiple of 32, leading batch dims.
  for (Shape3 s : {Shape3{1, 96, 40}, Shape3{8, 160, 33}, Shape3{9, 96, 40}, Shape3{3, 100, 7},
                   Shape3{20, 37, 5}}) {
    CAPTURE(s.m);
    CAPTURE(s.k);
    for (bool dq : {false, true}) {
      CAPTURE(dq);
      NF4Options o;
      o.block_size = 32;
      o.double_quant = dq;
      const BnbNF4State q = quantize_bnb(randn({s.n, s.k}, gen), o);
      const Tensor b = randn({s.n}, gen);
      const Tensor x = randn({s.m, s.k}, gen);
      const Tensor ref = linear(x.to(DType::f64), dequantize(q).to(DType::f64), b.to(DType::f64));
      CHECK(max_abs_diff(nf4_linear(x, q, b), ref) < 1e-4 * std::sqrt(double(s.k)));
      CHECK(max_abs_diff(nf4_linear(x.to(DType::f64), q, b.to(DType::f64)), ref) < 1e-10);
    }
  }
  // Blocks of 128 in bitsandbytes' layout (two runs per scale) compute what
  // the nf4 dtype at block 128 computes, bit for bit.
  NF4Options o128;
  o128.block_size = 128;
  o128.double_quant = false;
  const Tensor w = randn({24, 256}, gen);
  for (int64_t m : {3, 12}) {
    const Tensor x = randn({m, 256}, gen);
    CHECK(max_abs_diff(nf4_linear(x, quantize_bnb(w, o128)),
                       nf4_linear(x, quantize_nf4(w, o128))) == 0.0);
  }
  // Gradient in f64 against dequantize-then-linear's autograd.
  NF4Options o32;
  o32.block_size = 32;
  const BnbNF4State q = quantize_bnb(randn({5, 96}, gen), o32);
  for (int64_t m : {2, 12}) {
    Tensor x = randn({m, 96}, gen, {.dtype = DType::f64}).requires_grad_();
    const Tensor probe = randn({m, 5}, gen, {.dtype = DType::f64});
    sum(nf4_linear(x, q) * probe).backward();
    Tensor x2 = x.detach().clone().requires_grad_();
    sum(linear(x2, dequantize(q).to(DType::f64)) * probe).backward();
    CHECK(max_abs_diff(x.grad(), x2.grad()) < 1e-12);
  }
  CHECK_THROWS_WITH_AS(nf4_linear(zeros({2, 95}), q), doctest::Contains("[nf4_linear]"),
                       std::invalid_argument);
}

TEST_CASE(
    "nf4_linear under UnreadOutputGuard: zeros, the same input gradient, shared roundings kept") {
  Generator gen(21);
  NF4Options o;
  o.double_quant = true;
  const BnbNF4State q = quantize_bnb(randn({20, 128}, gen), o);
  const Tensor probe = randn({3, 20}, gen);
  for (const DType dd : {DType::f32, DType::bf16}) {
    INFO("dequant dtype ", dtype_name(dd));
    const Tensor x0 = randn({3, 128}, gen);
    Tensor x = x0.clone().requires_grad_();
    sum(nf4_linear(x, q, Tensor(), dd) * probe).backward();
    Tensor xu = x0.clone().requires_grad_();
    Tensor unread;
    {
      const UnreadOutputGuard guard;
      CHECK(output_unread());
      unread = nf4_linear(xu, q, Tensor(), dd);
    }
    CHECK_FALSE(output_unread());
    CHECK(unread.shape() == Shape{3, 20});
    CHECK(max_abs_diff(unread, zeros({3, 20})) == 0.0);
    sum(unread * probe).backward();
    CHECK(max_abs_diff(xu.grad(), x.grad()) == 0.0);
  }
  // A product that writes x's bf16 rounding for the others of a
  // SharedBf16Input still runs, so that they read it.
  const Tensor x = randn({3, 128}, gen);
  const Tensor want = nf4_linear(x, q, Tensor(), DType::bf16);
  Tensor first, second;
  {
    const SharedBf16Input shared(x);
    const UnreadOutputGuard guard;
    first = nf4_linear(x, q, Tensor(), DType::bf16);
    second = nf4_linear(x, q, Tensor(), DType::bf16);
  }
  CHECK(max_abs_diff(first, want) == 0.0);
  CHECK(max_abs_diff(second, zeros({3, 20})) == 0.0);
  // Off, it changes nothing.
  const UnreadOutputGuard off(false);
  CHECK(max_abs_diff(nf4_linear(x, q, Tensor(), DType::bf16), want) == 0.0);
}

TEST_CASE("nf4_linear multiplies by the weight rounded to its dequant dtype") {
  Generator gen(23);
  const Tensor w = randn({40, 128}, gen);
  const Tensor b = randn({40}, gen, {.dtype = DType::f64});
  NF4Options o32;
  o32.block_size = 32;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    CAPTURE(dt);
    const Tensor q = quantize_nf4(w);
    const BnbNF4State s = quantize_bnb(w, o32);
    for (int64_t m : {1, 5, 9, 30}) {  // fused and tiled
      CAPTURE(m);
      const Tensor x = randn({m, 128}, gen, {.dtype = DType::f64});
      const Tensor ref = linear(x, dequantize(q, dt).to(DType::f64), b);
      CHECK(max_abs_diff(nf4_linear(x, q, b, dt), ref) < 1e-10);
      const Tensor ref32 = linear(x, dequantize(s, dt).to(DType::f64), b);
      CHECK(max_abs_diff(nf4_linear(x, s, b, dt), ref32) < 1e-10);
      // f32 inputs: the fused kernels' rounded tables; with bf16 compute
      // over more than 8 rows the input is rounded to bf16 as well.
      const Tensor xf = x.to(DType::f32);
      const Tensor xr = rounds_input(dt, m) ? xf.to(DType::bf16).to(DType::f64) : x;
      CHECK(max_abs_diff(nf4_linear(xf, q, b.to(DType::f32), dt),
                         linear(xr, dequantize(q, dt).to(DType::f64), b)) < 1e-4);
      CHECK(max_abs_diff(nf4_linear(xf, s, b.to(DType::f32), dt),
                         linear(xr, dequantize(s, dt).to(DType::f64), b)) < 1e-4);
      // Backward uses the same rounded values.
      Tensor x1 = x.detach().clone().requires_grad_();
      Tensor x2 = x.detach().clone().requires_grad_();
      sum(nf4_linear(x1, q, Tensor(), dt)).backward();
      sum(linear(x2, dequantize(q, dt).to(DType::f64))).backward();
      CHECK(max_abs_diff(x1.grad(), x2.grad()) < 1e-12);
    }
  }
  // bf16 and f32 weights really differ (the rounding is not a no-op).
  const Tensor x = randn({2, 128}, gen);
  CHECK(max_abs_diff(nf4_linear(x, quantize_nf4(w), Tensor(), DType::bf16),
                     nf4_linear(x, quantize_nf4(w))) > 1e-4);
  CHECK_THROWS_WITH_AS(nf4_linear(x, quantize_nf4(w), Tensor(), DType::f64),
                       doctest::Contains("f32, bf16 or f16"), std::invalid_argument);
  // NF4Linear takes the dtype from its options; LoRALinear merges the same values.
  Linear lin(128, 40, gen);
  NF4Options obf;
  obf.dequant_dtype = DType::bf16;
  auto layer = std::make_shared<NF4Linear>(lin, obf);
  CHECK(layer->dequant_dtype() == DType::bf16);
  const Tensor want =
      linear(x, dequantize(layer->weight(), DType::bf16).to(DType::f32), lin.bias());
  CHECK(max_abs_diff((*layer)(x), want) < 1e-5);
  LoRALinear lora(layer, {.rank = 2, .alpha = 2, .dropout = 0.0, .seed = 3});
  CHECK(max_abs_diff(lora.merged_weight(),
                     dequantize(layer->weight(), DType::bf16).to(DType::f32)) == 0.0);
  NF4ConvertOptions co;
  co.format = obf;
  auto model = std::make_shared<Sequential>(std::make_shared<Linear>(128, 8, gen));
  const Tensor w0 = std::static_pointer_cast<Linear>((*model)[0])->weight().detach().clone();
  const auto reports = quantize_nf4(*model, co);
  auto converted = std::static_pointer_cast<NF4Linear>((*model)[0]);
  CHECK(converted->dequant_dtype() == DType::bf16);
  const NF4LayerReport r = quantization_error(w0, converted->weight(), DType::bf16);
  CHECK(reports[0].max_abs == r.max_abs);
  CHECK(reports[0].max_abs != quantization_error(w0, converted->weight()).max_abs);
}

TEST_CASE("nf4_linear's tiles and slabs across several of each, forward and backward") {
  // 8500 x 1000 = 8.5M elements. 3 rows: nine tiles of 1048 rows (aligned so
  // each starts on a run; in % 64 != 0 keeps 3 rows off the fused path); 130
  // rows: a slab of 8388 rows and one of 112, which starts mid-run.
  Generator gen(24);
  const int64_t n_out = 8500, n_in = 1000;
  REQUIRE(n_out * n_in > quant_cpu::kNF4SlabElems);
  REQUIRE(n_out * n_in < 2 * quant_cpu::kNF4SlabElems);
  REQUIRE(n_out * n_in > 8 * kNF4TileElems);
  REQUIRE(130 >= quant_cpu::kNF4SlabMinBatch);
  const Tensor w = randn({n_out, n_in}, gen);
  const Tensor q = quantize_nf4(w);
  NF4Options o32;
  o32.block_size = 32;
  const BnbNF4State s = quantize_bnb(w, o32);
  const Tensor b = randn({n_out}, gen, {.dtype = DType::f64});
  for (int64_t m : {3, 130}) {
    CAPTURE(m);
    const Tensor x = randn({m, n_in}, gen, {.dtype = DType::f64});
    const Tensor probe = randn({m, n_out}, gen, {.dtype = DType::f64});
    for (int which = 0; which < 2; ++which) {
      CAPTURE(which);
      const Tensor wd = (which == 0 ? dequantize(q) : dequantize(s)).to(DType::f64);
      Tensor x1 = x.detach().clone().requires_grad_();
      const Tensor y = which == 0 ? nf4_linear(x1, q, b) : nf4_linear(x1, s, b);
      Tensor x2 = x.detach().clone().requires_grad_();
      const Tensor ref = linear(x2, wd, b);
      CHECK(max_abs_diff(y, ref) < 1e-9);
      sum(y * probe).backward();
      sum(ref * probe).backward();
      CHECK(max_abs_diff(x1.grad(), x2.grad()) < 1e-9);
    }
  }
  // f32 across tiles as well.
  const Tensor xf = randn({16, n_in}, gen);
  const Tensor ref = linear(xf.to(DType::f64), dequantize(q).to(DType::f64));
  CHECK(max_abs_diff(nf4_linear(xf, q), ref) < 1e-4 * std::sqrt(double(n_in)));
}

TEST_CASE(
    "nf4_linear's bf16 compute, by bf16 products or by f32 products of bf16 values: bf16 input "
    "and weight, f32 sums, forward and backward") {
  // bitsandbytes' bf16 compute: the input (forward) and the output gradient
  // (backward) rounded to bf16, the weight decoded to bf16, f32 sums, on
  // every CPU: through bf16 products where they pay, else through f32
  // products of the same bf16 values (nf4_bf16_products_forced runs the
  // first everywhere, the plain suite the second where bf16 products do not
  // pay). Shapes: in a multiple of 64 and not, block 32 and 64, and a weight
  // of more than one slab (2^23 elements), whose backward accumulates slab
  // by slab.
  Generator gen(25);
  struct Case {
    int64_t m, k, n, block;
  };
  for (const Case c : {Case{9, 128, 40, 64}, Case{33, 96, 17, 32}, Case{130, 1000, 70, 64},
                       Case{12, 2048, 4097, 64}}) {
    CAPTURE(c.m);
    CAPTURE(c.k);
    CAPTURE(c.n);
    const Tensor w = randn({c.n, c.k}, gen);
    NF4Options o;
    o.block_size = c.block;
    const BnbNF4State s = quantize_bnb(w, o);
    const Tensor wd = dequantize(s, DType::bf16).to(DType::f64);
    const Tensor x = randn({c.m, c.k}, gen);
    const Tensor g = randn({c.m, c.n}, gen);
    Tensor x1 = x.detach().clone().requires_grad_();
    const Tensor y = nf4_linear(x1, s, Tensor(), DType::bf16);
    y.backward(g);
    const Tensor y_ref = linear(x.to(DType::bf16).to(DType::f64), wd);
    const Tensor dx_ref = matmul(g.to(DType::bf16).to(DType::f64), wd);
    const double tol = 1e-5 * std::sqrt(double(std::max(c.k, c.n)));
    CHECK(y.dtype() == DType::f32);
    CHECK(max_abs_diff(y, y_ref) < tol * (1.0 + max(abs(y_ref)).item()));
    CHECK(max_abs_diff(x1.grad(), dx_ref) < tol * (1.0 + max(abs(dx_ref)).item()));
    // Rounding the input is the difference: an f32-input reference is off.
    if (c.k == 128) CHECK(max_abs_diff(y, linear(x.to(DType::f64), wd)) > 1e-4);
  }
}

TEST_CASE(
    "nf4_linear's bf16 compute (bf16 products, or f32 products of bf16 values) under "
    "SharedBf16Input: one rounding of x, the same bits") {
  // q, k and v of one input: under a guard of x the first product rounds x
  // into the guard's buffer and the others read it. Every output and
  // gradient has the bits of the unguarded products; the buffer holds
  // bf16(x) after the first; a small batch (fused kernel, which multiplies
  // in f32) still writes it for the products after it; a guard of another
  // tensor, or a guard that has ended, shares nothing.
  std::vector<Device> devices{Device::cpu()};
  for (const Device& d : testing::test_devices()) devices.push_back(d);
  for (const Device& device : devices)
    for (const int64_t m : {int64_t{3}, int64_t{70}}) {
      CAPTURE(device);
      CAPTURE(m);
      Generator gen(41);
      const Tensor x = randn({m, 96}, gen).to(device);
      std::vector<BnbNF4State> weights;
      // Host states: nf4_linear moves their bytes and scales to x's device.
      for (const int64_t n : {40, 24, 64}) weights.push_back(quantize_bnb(randn({n, 96}, gen)));
      const auto run = [&](bool guarded) {
        const Tensor xg = x.detach().clone().requires_grad_();
        std::vector<Tensor> out;
        {
          const std::optional<SharedBf16Input> guard =
              guarded ? std::optional<SharedBf16Input>(std::in_place, xg) : std::nullopt;
          Tensor loss;
          for (size_t i = 0; i < weights.size(); ++i) {
            const Tensor y = nf4_linear(xg, weights[i], Tensor(), DType::bf16);
            out.push_back(y.detach().to(Device::cpu()));
            if (guarded && i == 0) {
              const quanta::detail::SharedBf16Slot* slot = quanta::detail::shared_bf16_input(xg);
              REQUIRE(slot != nullptr);
              CHECK(slot->written);
              CHECK(bytes_of(slot->rounded.to(Device::cpu())) ==
                    bytes_of(x.to(Device::cpu()).to(DType::bf16)));
            }
            loss = loss.defined() ? loss + sum(y * y) : sum(y * y);
          }
          loss.backward();
        }
        out.push_back(xg.grad().to(Device::cpu()));
        return out;
      };
      const std::vector<Tensor> plain = run(false), shared = run(true);
      for (size_t i = 0; i < plain.size(); ++i) {
        CAPTURE(i);
        CHECK(bytes_of(shared[i]) == bytes_of(plain[i]));
      }
      // Another tensor of the same shape and values, and an ended guard.
      const Tensor other = x.detach().clone();
      {
        const SharedBf16Input guard(x);
        CHECK(quanta::detail::shared_bf16_input(other) == nullptr);
        CHECK(quanta::detail::shared_bf16_input(x.narrow(0, 0, 1)) == nullptr);
        {
          const SharedBf16Input inner(other);  // nested: each finds its own
          CHECK(quanta::detail::shared_bf16_input(x) != nullptr);
          CHECK(quanta::detail::shared_bf16_input(other) != quanta::detail::shared_bf16_input(x));
        }
      }
      CHECK(quanta::detail::shared_bf16_input(x) == nullptr);
    }
  // A guard of a non-f32 tensor does nothing.
  const Tensor x64 = zeros({4, 4}, {.dtype = DType::f64});
  const SharedBf16Input guard(x64);
  CHECK(quanta::detail::shared_bf16_input(x64) == nullptr);
}

TEST_CASE("nf4_linear zero-size inputs and argument errors") {
  Generator gen(2);
  const Tensor q = quantize_nf4(randn({6, 64}, gen));
  CHECK(nf4_linear(zeros({0, 64}), q).shape() == Shape{0, 6});
  const Tensor x0 = zeros({0, 64}).requires_grad_();
  sum(nf4_linear(x0, q)).backward();
  CHECK(x0.grad().shape() == Shape{0, 64});
  CHECK_THROWS_WITH_AS(nf4_linear(zeros({2, 65}), q), doctest::Contains("[nf4_linear]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(nf4_linear(zeros({2, 64}), randn({6, 64}, gen)),
                       doctest::Contains("expects an nf4 tensor"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(nf4_linear(zeros({2, 64}, {.dtype = DType::i32}), q),
                       doctest::Contains("f32 or f64"), std::invalid_argument);
  // Asking for the weight's gradient: an nf4 tensor cannot require grad.
  Tensor qw = q.detach();
  CHECK_THROWS_WITH_AS(qw.requires_grad_(), doctest::Contains("nf4"), std::invalid_argument);
}

TEST_CASE("nf4_linear gradient: f64 check of dx and dbias") {
  Generator gen(31);
  for (int64_t m : {2, 12}) {  // fused path and tiled path
    CAPTURE(m);
    const Tensor q = quantize_nf4(randn({5, 128}, gen));
    const Tensor wd = dequantize(q).to(DType::f64);
    Tensor x = randn({m, 128}, gen, {.dtype = DType::f64}).requires_grad_();
    Tensor b = randn({5}, gen, {.dtype = DType::f64}).requires_grad_();
    const Tensor probe = randn({m, 5}, gen, {.dtype = DType::f64});
    sum(nf4_linear(x, q, b) * probe).backward();
    // Against dequantize-then-linear's autograd.
    Tensor x2 = x.detach().clone().requires_grad_();
    Tensor b2 = b.detach().clone().requires_grad_();
    sum(linear(x2, wd, b2) * probe).backward();
    CHECK(max_abs_diff(x.grad(), x2.grad()) < 1e-12);
    CHECK(max_abs_diff(b.grad(), b2.grad()) < 1e-12);
    // Against central differences of nf4_linear itself.
    const Tensor num = numeric_grad(
        [&](const Tensor& xx) { return sum(nf4_linear(xx, q, b.detach()) * probe).item(); },
        x.detach());
    CHECK(max_abs_diff(x.grad(), num) < 1e-6);
  }
}

TEST_CASE("NF4Linear: forward, frozen parameters, state dict bytes round trip") {
  Generator gen(41);
  Linear lin(64, 10, gen);
  NF4Linear q(lin);
  CHECK(q.weight().dtype() == DType::nf4);
  CHECK(q.parameters().size() == 1);
  CHECK(!q.bias().requires_grad());
  const Tensor x = randn({4, 64}, gen);
  CHECK(max_abs_diff(q(x), linear(x, dequantize(q.weight()), lin.bias())) < 1e-5);

  const StateDict sd = q.state_dict();
  const std::string path =
      (std::filesystem::temp_directory_path() / "quanta_nf4_linear_sd.safetensors").string();
  io::save_safetensors(path, sd);
  const io::SafetensorsFile f = io::load_safetensors(path);
  std::filesystem::remove(path);
  NF4Linear other(quantize_nf4(zeros({10, 64})), zeros({10}));
  other.load_state_dict(f.tensors);
  CHECK(bytes_of(other.weight()) == bytes_of(q.weight()));
  CHECK(max_abs_diff(other(x), q(x)) == 0.0);
}

TEST_CASE("NF4Linear at block 32: bitsandbytes' state as buffers, state dict round trip") {
  Generator gen(42);
  Linear lin(96, 10, gen);
  for (bool dq : {false, true}) {
    CAPTURE(dq);
    NF4Options o;
    o.block_size = 32;
    o.double_quant = dq;
    NF4Linear q(lin, o);
    CHECK(q.is_bnb());
    CHECK(q.in_features() == 96);
    CHECK(q.out_features() == 10);
    const BnbNF4State s = q.bnb_weight();
    CHECK(s.blocksize == 32);
    CHECK(bytes_of(s.packed) == bytes_of(quantize_bnb(lin.weight(), o).packed));
    const Tensor x = randn({4, 96}, gen);
    CHECK(max_abs_diff(q(x), linear(x, dequantize(s), lin.bias())) < 1e-5);
    CHECK(q.weight_bytes() == bnb_payload_bytes(s));
    std::vector<std::string> names;
    for (const auto& [n, t] : q.state_dict()) names.push_back(n);
    std::vector<std::string> want = {"bias", "weight", "weight_absmax"};
    if (dq)
      want = {"bias",
              "weight",
              "weight_absmax",
              "weight_nested_absmax",
              "weight_nested_quant_map",
              "weight_nested_offset"};
    CHECK(names == want);
    // Load into a layer of the same configuration quantized from other weights.
    Linear other_lin(96, 10, gen);
    NF4Linear other(other_lin, o);
    CHECK(max_abs_diff(other(x), q(x)) > 0.0);
    const auto file = io::parse_safetensors(io::serialize_safetensors(q.state_dict()));
    other.load_state_dict(file.tensors);
    CHECK(max_abs_diff(other(x), q(x)) == 0.0);
    CHECK_THROWS_WITH_AS(NF4Linear(lin).bnb_weight(), doctest::Contains("to_bnb"),
                         std::invalid_argument);
  }
  // quantize_nf4(module) at block 32, with LoRA adapters on top.
  auto model =
      std::make_shared<Sequential>(std::make_shared<Linear>(32, 64, gen), std::make_shared<Tanh>(),
                                   std::make_shared<Linear>(64, 4, gen));
  const Tensor x = randn({5, 32}, gen);
  const Tensor before = (*model)(x);
  NF4ConvertOptions co;
  co.format.block_size = 32;
  co.lora = true;
  const auto reports = quantize_nf4(*model, co);
  REQUIRE(reports.size() == 2);
  // 64 x 32 weight: 1024 code bytes, 64 scale codes, one group scale.
  CHECK(reports[0].bytes_after == 1024 + 64 + 4);
  auto lora = std::static_pointer_cast<LoRALinear>((*model)[0]);
  CHECK(lora->base()->is_bnb());
  CHECK(max_abs_diff((*lora->merge())(x), (*lora)(x)) < 1e-5);
  CHECK(max_abs_diff((*model)(x), before) < 0.1 * max(abs(before)).item() + 0.05);
}

TEST_CASE("NF4Linear at block 32 on a device: scales built once, no host sync per forward") {
  Generator gen(43);
  Linear lin(96, 10, gen), other_lin(96, 10, gen);
  NF4Options o;
  o.block_size = 32;
  o.double_quant = true;
  const Tensor x = randn({4, 96}, gen);
  for (const Device device : quanta::testing::test_devices()) {
    CAPTURE(device.str());
    NF4Linear on_cpu(lin, o), on_device(lin, o);
    on_device.to(device);
    Tensor y;
    {
      HostSyncGuard guard("the forwards and backward of a bitsandbytes-layout layer");
      for (int i = 0; i < 3; ++i) y = on_device(x.to(device).requires_grad_(true));
      sum(y).backward();
    }
    // sim: the CPU's bits; a GPU's dot products add in another order.
    const double tol = device.is_sim() ? 0.0 : 1e-5;
    CHECK(max_abs_diff(y.to(Device::cpu()), on_cpu(x)) <= tol);
    // A load replaces the state on the device; the scales follow it.
    NF4Linear other(other_lin, o);
    on_device.load_state_dict(other.state_dict());
    CHECK(max_abs_diff(on_device(x.to(device)).to(Device::cpu()), other(x)) <= tol);
  }
}

TEST_CASE("quantize_nf4(module) converts Linear layers in place with include/exclude") {
  Generator gen(43);
  auto model =
      std::make_shared<Sequential>(std::make_shared<Linear>(32, 64, gen), std::make_shared<ReLU>(),
                                   std::make_shared<Linear>(64, 64, gen), std::make_shared<ReLU>(),
                                   std::make_shared<Linear>(64, 4, gen));
  const Tensor x = randn({5, 32}, gen);
  const Tensor before = (*model)(x);
  NF4ConvertOptions o;
  o.exclude = {"4"};
  const auto reports = quantize_nf4(*model, o);
  REQUIRE(reports.size() == 2);
  CHECK(reports[0].name == "0");
  CHECK(reports[1].name == "2");
  for (const auto& r : reports) {
    CHECK(r.rmse > 0);
    CHECK(r.max_abs >= r.rmse);
    CHECK(r.bytes_after * 7 < r.bytes_before);
  }
  CHECK((*model)[0]->type_name() == "NF4Linear");
  CHECK((*model)[2]->type_name() == "NF4Linear");
  CHECK((*model)[4]->type_name() == "Linear");
  // Still close to the float model: 4-bit error only.
  const Tensor after = (*model)(x);
  CHECK(max_abs_diff(after, before) < 0.1 * max(abs(before)).item() + 0.05);
}

TEST_CASE("LoRALinear: zero-initialised B, merge, state dict round trip") {
  Generator gen(47);
  Linear lin(64, 12, gen);
  auto base = std::make_shared<NF4Linear>(lin);
  LoRALinear lora(base, {.rank = 4, .alpha = 8, .dropout = 0.0, .seed = 1});
  const Tensor x = randn({3, 64}, gen);
  CHECK(max_abs_diff(lora(x), (*base)(x)) == 0.0);  // B = 0
  {
    NoGradGuard ng;
    copy_(lora.lora_B(), randn({12, 4}, gen));
  }
  CHECK(lora.scaling() == 2.0);
  const auto merged = lora.merge();
  CHECK(max_abs_diff((*merged)(x), lora(x)) < 1e-4);
  const StateDict sd = lora.state_dict();
  std::vector<std::string> names;
  for (const auto& [n, t] : sd) names.push_back(n);
  CHECK(names == std::vector<std::string>{"lora_A", "lora_B", "base.bias", "base.weight"});
  LoRALinear other(std::make_shared<NF4Linear>(quantize_nf4(zeros({12, 64})), zeros({12})),
                   {.rank = 4, .alpha = 8, .dropout = 0.0, .seed = 2});
  const auto file = io::parse_safetensors(io::serialize_safetensors(sd));
  other.load_state_dict(file.tensors);
  CHECK(max_abs_diff(other(x), lora(x)) == 0.0);
}

TEST_CASE("LoRALinear with lora_bias: B's bias scaled with the product, merged, f64 gradients") {
  Generator gen(49);
  Linear lin(24, 10, gen);
  // f64 adapters over an f64 bias, as an f64 model has them.
  auto base = std::make_shared<NF4Linear>(quantize_nf4(lin.weight().detach()),
                                          lin.bias().detach().to(DType::f64));
  LoRALinear lora(base,
                  {.rank = 3, .alpha = 6, .dropout = 0.2, .dtype = DType::f64, .lora_bias = true});
  REQUIRE(lora.lora_B_bias().defined());
  const Tensor x = randn({5, 24}, gen, {.dtype = DType::f64});
  lora.eval();
  CHECK(max_abs_diff(lora(x), (*base)(x)) == 0.0);  // B and its bias start at 0
  {
    NoGradGuard ng;
    copy_(lora.lora_B(), randn({10, 3}, gen, {.dtype = DType::f64}) * 0.1);
    copy_(lora.lora_B_bias(), randn({10}, gen, {.dtype = DType::f64}) * 0.1);
  }
  // (x A^T B^T + b_B) s over the frozen output.
  const Tensor want =
      (*base)(x) + (linear(linear(x, lora.lora_A()), lora.lora_B()) + lora.lora_B_bias()) * 2.0;
  CHECK(max_abs_diff(lora(x), want) < 1e-12);
  CHECK(max_abs_diff((*lora.merge())(x.to(DType::f32)), lora(x)) < 1e-5);
  CHECK(max_abs_diff(lora.merged_bias(), base->bias() + lora.lora_B_bias() * 2.0) < 1e-15);
  std::vector<std::string> names;
  for (const auto& [n, t] : lora.adapter_tensors()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"lora_A.weight", "lora_B.weight", "lora_B.bias"});

  // Training, with dropout: every trained tensor's gradient by finite differences.
  lora.train();
  const Tensor probe = randn({5, 10}, gen, {.dtype = DType::f64});
  const GeneratorState draws = lora.dropout_generator().state();
  const auto loss = [&] {
    lora.dropout_generator().set_state(draws);
    return sum(lora(x) * probe);
  };
  loss().backward();
  for (const Tensor& p : {lora.lora_A(), lora.lora_B(), lora.lora_B_bias()})
    CHECK(max_abs_diff(p.grad(), numeric_grad(p, [&] { return loss().item(); })) < 1e-7);

  // Nowhere to merge B's bias without the base's own; DoRA refuses it.
  LoRALinear no_bias(std::make_shared<NF4Linear>(quantize_nf4(lin.weight().detach()), Tensor()),
                     {.rank = 3, .alpha = 6, .lora_bias = true});
  CHECK_THROWS_WITH_AS(no_bias.merged_bias(), doctest::Contains("without a bias"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(LoRALinear(base, {.rank = 3, .use_dora = true, .lora_bias = true}),
                       doctest::Contains("lora_bias is not available with DoRA"),
                       std::invalid_argument);
}

TEST_CASE("LoRALinear: an input read by several layers gets their gradients summed in place") {
  // Like q, k and v over one input: each layer's adapter and frozen product
  // add onto the sum of the gradients that already reached it (the engine's
  // gradient_sink) instead of a fresh buffer apiece. The sum must equal each
  // layer's gradient taken alone, with the same dropout draws; bf16 compute
  // takes the CPU's bf16 products where it has them.
  for (const DType dt : {DType::f32, DType::f64})
    for (const DType dd : {DType::f32, DType::bf16}) {
      CAPTURE(dt);
      CAPTURE(dd);
      Generator gen(61);
      std::vector<std::shared_ptr<LoRALinear>> layers;
      std::vector<Tensor> probes;
      for (int i = 0; i < 3; ++i) {
        Linear lin(96, 40 + 8 * i, gen, /*bias=*/false);
        NF4Options o;
        o.dequant_dtype = dd;
        auto layer = std::make_shared<LoRALinear>(
            std::make_shared<NF4Linear>(lin, o),
            LoRAOptions{.rank = 4, .alpha = 8, .dropout = 0.2, .dtype = dt, .seed = uint64_t(i)});
        {
          NoGradGuard ng;
          copy_(layer->lora_B(), randn(layer->lora_B().shape(), gen, {.dtype = dt}));
        }
        layers.push_back(layer);
        probes.push_back(randn({70, 40 + 8 * i}, gen, {.dtype = dt}));
      }
      std::vector<GeneratorState> states;
      for (auto& l : layers) states.push_back(l->dropout_generator().state());
      const auto rewind = [&] {
        for (size_t i = 0; i < layers.size(); ++i)
          layers[i]->dropout_generator().set_state(states[i]);
      };
      const Tensor x0 = randn({70, 96}, gen, {.dtype = dt});
      Tensor alone = zeros_like(x0);
      rewind();
      for (size_t i = 0; i < layers.size(); ++i) {
        Tensor x = x0.clone().requires_grad_();
        sum((*layers[i])(x)*probes[i]).backward();
        alone = alone + x.grad();
      }
      rewind();
      Tensor x = x0.clone().requires_grad_();
      const Tensor h = x * 1.0;  // a node's output, as a norm's is
      Tensor loss = sum((*layers[0])(h)*probes[0]);
      for (size_t i = 1; i < layers.size(); ++i) loss = loss + sum((*layers[i])(h)*probes[i]);
      loss.backward();
      const double tol = dt == DType::f32 ? 1e-5 : 1e-12;
      CHECK(max_abs_diff(x.grad(), alone) <= tol * max(abs(alone)).item());
    }
}

TEST_CASE("LoRA training: a frozen NF4 MLP plus adapters learns a synthetic task") {
  Generator gen(53);
  auto model =
      std::make_shared<Sequential>(std::make_shared<Linear>(16, 64, gen), std::make_shared<Tanh>(),
                                   std::make_shared<Linear>(64, 4, gen));
  // Task: a different random MLP (the teacher) on Gaussian inputs.
  Linear t1(16, 32, gen), t2(32, 4, gen);
  const Tensor x = randn({256, 16}, gen);
  const Tensor target = [&] {
    NoGradGuard ng;
    return t2(tanh(t1(x))) * 3.0;
  }();
  NF4ConvertOptions o;
  o.lora = true;
  o.lora_options = {.rank = 8, .alpha = 16, .dropout = 0.05, .seed = 5};
  quantize_nf4(*model, o);
  std::vector<std::vector<uint8_t>> frozen;
  for (const auto& [n, b] : model->named_buffers()) frozen.push_back(bytes_of(b));
  const auto params = model->parameters();
  std::vector<Tensor> trainable;
  for (const auto& p : params)
    if (p.requires_grad()) trainable.push_back(p);
  CHECK(trainable.size() == 4);  // lora_A, lora_B of two layers
  Adam opt(trainable, {.lr = 1e-2});
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    opt.zero_grad();
    Tensor loss = mse_loss((*model)(x), target);
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item();
    last = loss.item();
  }
  model->eval();
  const double eval_loss = mse_loss((*model)(x), target).item();
  MESSAGE("LoRA loss " << first << " -> " << last << " (eval " << eval_loss << ")");
  CHECK(eval_loss < 0.2 * first);
  size_t i = 0;
  for (const auto& [n, b] : model->named_buffers()) CHECK(bytes_of(b) == frozen[i++]);
}

TEST_CASE("LoRALinear on an NF4 base on cuda:0: forward and gradients equal the CPU's") {
  if (!quanta::testing::have_gpu()) MESSAGE("cuda:0 skipped: " << quanta::testing::no_gpu_reason());
  for (const Device gpu : quanta::testing::test_devices()) {
    INFO("on ", gpu.str());
    // Batch 4 takes the fused GEMV on both devices, 40 the tiled path; the
    // dropout masks come from the same stream on both (bernoulli draws on the
    // device by the CPU's rule).
    for (int64_t batch : {4, 40}) {
      INFO("batch ", batch);
      Generator gen(48);
      Linear lin(128, 24, gen);
      auto make = [&] {
        auto l = std::make_shared<LoRALinear>(
            std::make_shared<NF4Linear>(lin),
            LoRAOptions{.rank = 4, .alpha = 8, .dropout = 0.25, .seed = 5});
        NoGradGuard ng;
        Generator b(9);
        copy_(l->lora_B(), randn({24, 4}, b));  // B = 0 would hide the adapters
        return l;
      };
      auto on_cpu = make(), on_gpu = make();
      on_gpu->to(gpu);
      const Tensor x = randn({batch, 128}, gen), w = randn({batch, 24}, gen);
      Tensor xc = x.clone().requires_grad_(true), xg = x.to(gpu).requires_grad_(true);
      const Tensor yc = (*on_cpu)(xc), yg = (*on_gpu)(xg);
      CHECK(yg.device() == gpu);
      CHECK(max_abs_diff(yg.to(Device::cpu()), yc) < 1e-4);
      sum(yc * w).backward();
      sum(yg * w.to(gpu)).backward();
      CHECK(max_abs_diff(xg.grad().to(Device::cpu()), xc.grad()) < 1e-4);
      CHECK(max_abs_diff(on_gpu->lora_A().grad().to(Device::cpu()), on_cpu->lora_A().grad()) <
            1e-3);
      CHECK(max_abs_diff(on_gpu->lora_B().grad().to(Device::cpu()), on_cpu->lora_B().grad()) <
            1e-3);
    }
  }
}
