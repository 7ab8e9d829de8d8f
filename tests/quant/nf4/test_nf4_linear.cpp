// nf4_linear against dequantize-then-linear, its f64 gradient, and the
// NF4Linear / LoRALinear modules (state dicts, merge, a LoRA training run).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "quanta.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_linear.h"
#include "quant/nf4/nf4_modules.h"

using namespace quanta;
using namespace quanta::quant;

namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(DType::f64) - b.to(DType::f64))).item();
}

// f64 central differences of sum(f(x) * probe) with respect to x.
Tensor numeric_grad(const std::function<Tensor(const Tensor&)>& f, const Tensor& x,
                    const Tensor& probe, double h = 1e-6) {
  Tensor g = zeros(x.shape(), {.dtype = DType::f64});
  Tensor xc = x.detach().clone();
  double* px = xc.data<double>();
  double* pg = g.data<double>();
  for (int64_t i = 0; i < xc.numel(); ++i) {
    const double keep = px[i];
    px[i] = keep + h;
    const double up = sum(f(xc) * probe).item();
    px[i] = keep - h;
    const double down = sum(f(xc) * probe).item();
    px[i] = keep;
    pg[i] = (up - down) / (2 * h);
  }
  return g;
}

}  // namespace

TEST_CASE("nf4_linear forward equals dequantize-then-linear on every path") {
  Generator gen(21);
  struct Shape3 { int64_t m, k, n; };
  // Fused small batch (k % 64 == 0), tiled GEMM, k not a multiple of 64,
  // leading batch dims, tiles smaller than the weight.
  for (Shape3 s : {Shape3{1, 128, 40}, Shape3{8, 192, 33}, Shape3{9, 128, 40},
                   Shape3{20, 100, 7}, Shape3{3, 37, 5}, Shape3{64, 4096, 80}}) {
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
    const Tensor num = numeric_grad([&](const Tensor& xx) { return nf4_linear(xx, q, b.detach()); },
                                    x.detach(), probe);
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

TEST_CASE("quantize_nf4(module) converts Linear layers in place with include/exclude") {
  Generator gen(43);
  auto model = std::make_shared<Sequential>(std::make_shared<Linear>(32, 64, gen),
                                            std::make_shared<ReLU>(),
                                            std::make_shared<Linear>(64, 64, gen),
                                            std::make_shared<ReLU>(),
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

TEST_CASE("LoRA training: a frozen NF4 MLP plus adapters learns a synthetic task") {
  Generator gen(53);
  auto model = std::make_shared<Sequential>(std::make_shared<Linear>(16, 64, gen),
                                            std::make_shared<Tanh>(),
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
