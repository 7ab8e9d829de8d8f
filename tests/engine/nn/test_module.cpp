// Modules: naming and order, modes, state dicts, device/dtype moves, layers
// against explicit computations, and initialiser statistics.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>

#include "quanta.h"
#include "support/errors.h"

using namespace quanta;
using quanta::testing::message_of;

namespace {

// A module with a parameter, a buffer and a nested Sequential, to check names.
struct Net : Module {
  Tensor w, running, scratch;
  std::shared_ptr<Sequential> seq;
  explicit Net(Generator& gen) : Module("Net") {
    w = register_parameter("w", zeros({2}));
    running = register_buffer("running", ones({3}));
    scratch = register_buffer("scratch", zeros({1}), /*persistent=*/false);
    seq = register_module("seq", std::make_shared<Sequential>(
                                     std::make_shared<Linear>(3, 4, gen), std::make_shared<ReLU>(),
                                     std::make_shared<Linear>(4, 2, gen, /*bias=*/false)));
  }
};

std::vector<std::string> names(const std::vector<std::pair<std::string, Tensor>>& xs) {
  std::vector<std::string> out;
  for (const auto& [n, t] : xs) out.push_back(n);
  return out;
}

double vmax(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double vmin(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double vmean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}
double vstd(const std::vector<double>& v) {
  const double m = vmean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("parameters, buffers and modules are named with dotted paths in order") {
  Generator gen(1);
  Net net(gen);
  CHECK(names(net.named_parameters()) ==
        std::vector<std::string>{"w", "seq.0.weight", "seq.0.bias", "seq.2.weight"});
  CHECK(names(net.named_parameters(/*recurse=*/false)) == std::vector<std::string>{"w"});
  CHECK(names(net.named_buffers()) == std::vector<std::string>{"running", "scratch"});
  std::vector<std::string> mods;
  for (auto& [n, m] : net.named_modules()) mods.push_back(n + ":" + m->type_name());
  CHECK(mods == std::vector<std::string>{":Net", "seq:Sequential", "seq.0:Linear", "seq.1:ReLU",
                                         "seq.2:Linear"});
  CHECK(net.named_children().size() == 1);
  // Parameters are leaves requiring grad; buffers are not trained.
  for (const Tensor& p : net.parameters()) {
    CHECK(p.requires_grad());
    CHECK(p.is_leaf());
  }
  CHECK_FALSE(net.running.requires_grad());
  // The state dict holds parameters then persistent buffers, module by module.
  CHECK(names(net.state_dict()) ==
        std::vector<std::string>{"w", "running", "seq.0.weight", "seq.0.bias", "seq.2.weight"});
  CHECK(net.find("seq.0.bias").is_same(std::static_pointer_cast<Linear>((*net.seq)[0])->bias()));
  CHECK(net.find("running").is_same(net.running));
  CHECK_FALSE(net.find("seq.9.weight").defined());
  CHECK_FALSE(net.find("nope").defined());
}

TEST_CASE("registration rejects bad names and dtypes") {
  Module m("M");
  m.register_parameter("a", zeros({1}));
  CHECK_THROWS_WITH_AS(m.register_parameter("a", zeros({1})),
                       doctest::Contains("already a parameter"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(m.register_buffer("a", zeros({1})), doctest::Contains("already a parameter"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(m.register_parameter("b.c", zeros({1})), doctest::Contains("'.'"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(m.register_parameter("", zeros({1})), doctest::Contains("empty"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(m.register_parameter("i", zeros({1}, {.dtype = DType::i64})),
                       doctest::Contains("i64"), std::invalid_argument);
  CHECK_THROWS_AS(m.register_module("n", std::shared_ptr<Module>()), std::invalid_argument);
  CHECK_THROWS_WITH_AS(m.forward(zeros({1})), doctest::Contains("[M]"), std::invalid_argument);
  // A frozen parameter is listed but does not require grad.
  Tensor f = m.register_parameter("frozen", ones({2}), /*requires_grad=*/false);
  CHECK_FALSE(f.requires_grad());
  CHECK(m.parameters().size() == 2);
}

TEST_CASE("a shared parameter is listed once but saved under every name") {
  Generator gen(2);
  auto a = std::make_shared<Linear>(2, 2, gen);
  Sequential s(a, std::make_shared<Tanh>(), a);
  CHECK(names(s.named_parameters()) == std::vector<std::string>{"0.weight", "0.bias"});
  CHECK(s.named_modules().size() == 3);  // "", "0", "1"
  CHECK(names(s.state_dict()) ==
        std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
}

TEST_CASE("train and eval recurse into every submodule") {
  Generator gen(3);
  Net net(gen);
  for (auto& [n, m] : net.named_modules()) CHECK(m->is_training());
  net.eval();
  for (auto& [n, m] : net.named_modules()) CHECK_FALSE(m->is_training());
  net.seq->train();
  CHECK_FALSE(net.is_training());
  CHECK((*net.seq)[1]->is_training());
  net.train();
  for (auto& [n, m] : net.named_modules()) CHECK(m->is_training());
}

TEST_CASE("zero_grad drops every parameter's gradient") {
  Generator gen(4);
  Linear lin(3, 2, gen);
  sum(lin(ones({5, 3}))).backward();
  CHECK(lin.weight().grad().defined());
  CHECK(lin.bias().grad().defined());
  lin.zero_grad();
  CHECK_FALSE(lin.weight().grad().defined());
  CHECK_FALSE(lin.bias().grad().defined());
}

TEST_CASE("state_dict round trip copies values in place") {
  Generator g1(10), g2(20);
  Net a(g1), b(g2);
  fill_(a.running, 7.0);
  const Tensor w_before = b.seq->named_parameters()[0].second;
  CHECK(w_before.to_vector<float>() != a.find("seq.0.weight").to_vector<float>());
  const LoadResult r = b.load_state_dict(a.state_dict());
  CHECK(r.missing_keys.empty());
  CHECK(r.unexpected_keys.empty());
  for (const auto& [name, t] : a.state_dict()) {
    CAPTURE(name);
    CHECK(b.find(name).to_vector<float>() == t.to_vector<float>());
    // Copied, not aliased.
    CHECK(b.find(name).storage() != t.storage());
  }
  // Same handles: layers and optimisers keep working with them.
  CHECK(b.seq->named_parameters()[0].second.is_same(w_before));
  CHECK(b.find("running").to_vector<float>() == std::vector<float>{7, 7, 7});
  // Values of state_dict() are views of the live tensors.
  Tensor view = a.state_dict()[1].second;
  CHECK(view.storage() == a.running.storage());
  CHECK_FALSE(view.requires_grad());
}

TEST_CASE("load_state_dict names every missing, unexpected and mis-shaped key") {
  Generator gen(5);
  Net net(gen);
  StateDict sd = net.state_dict();
  const std::vector<float> w0 = net.find("seq.0.weight").to_vector<float>();
  StateDict bad;
  for (const auto& [k, v] : sd) {
    if (k == "running" || k == "seq.2.weight") continue;  // missing
    if (k == "seq.0.weight")
      bad.emplace_back(k, zeros({3, 4}));  // transposed
    else if (k == "w")
      bad.emplace_back(k, zeros({2}, {.dtype = DType::f64}));  // dtype
    else
      bad.emplace_back(k, zeros_like(v));
  }
  bad.emplace_back("extra", zeros({1}));
  bad.emplace_back("seq.5.bias", zeros({1}));
  const std::string msg = message_of([&] { net.load_state_dict(bad); });
  CAPTURE(msg);
  CHECK(contains(msg, "[Net::load_state_dict]"));
  CHECK(contains(msg, "missing keys: running, seq.2.weight"));
  CHECK(contains(msg, "unexpected keys: extra, seq.5.bias"));
  CHECK(contains(msg, "w (expected [2] f32, got [2] f64)"));
  CHECK(contains(msg, "seq.0.weight (expected [4, 3] f32, got [3, 4] f32)"));
  // Nothing was copied.
  CHECK(net.find("seq.0.weight").to_vector<float>() == w0);

  // Non-strict: missing and unexpected keys are tolerated and reported, but a
  // wrong shape is still an error.
  CHECK_THROWS_WITH_AS(net.load_state_dict(bad, /*strict=*/false),
                       doctest::Contains("mismatched keys"), std::invalid_argument);
  StateDict partial;
  partial.emplace_back("seq.0.bias", full({4}, 3.0));
  partial.emplace_back("extra", zeros({1}));
  const LoadResult r = net.load_state_dict(partial, /*strict=*/false);
  CHECK(r.unexpected_keys == std::vector<std::string>{"extra"});
  CHECK(r.missing_keys == std::vector<std::string>{"w", "running", "seq.0.weight", "seq.2.weight"});
  CHECK(net.find("seq.0.bias").to_vector<float>() == std::vector<float>{3, 3, 3, 3});
  // Duplicate keys are refused.
  StateDict dup = net.state_dict();
  dup.push_back(dup[0]);
  CHECK_THROWS_WITH_AS(net.load_state_dict(dup), doctest::Contains("duplicate keys: w"),
                       std::invalid_argument);
}

TEST_CASE("state dict prefixes merge and split checkpoints") {
  StateDict sd{{"a", zeros({1})}, {"b", ones({1})}};
  StateDict merged = add_prefix(sd, "model.");
  merged.emplace_back("optim.step", zeros({}));
  CHECK(names(merged) == std::vector<std::string>{"model.a", "model.b", "optim.step"});
  CHECK(names(strip_prefix(merged, "model.")) == std::vector<std::string>{"a", "b"});
  CHECK(find_tensor(merged, "model.b") != nullptr);
  CHECK(find_tensor(merged, "b") == nullptr);
}

TEST_CASE("to(dtype) casts parameters and gradients in place") {
  Generator gen(6);
  Linear lin(3, 2, gen);
  Tensor w = lin.weight();
  const std::vector<float> before = w.to_vector<float>();
  sum(lin(ones({1, 3}))).backward();
  lin.to(DType::f64);
  CHECK(w.dtype() == DType::f64);
  CHECK(lin.weight().is_same(w));
  CHECK(w.requires_grad());
  CHECK(w.grad().dtype() == DType::f64);
  CHECK(w.to_vector<float>() == before);
  // The converted module trains: gradients reach the same handles.
  lin.zero_grad();
  sum(lin(ones({1, 3}, {.dtype = DType::f64}))).backward();
  CHECK(w.grad().dtype() == DType::f64);
  CHECK(w.grad().to_vector<double>() == std::vector<double>{1, 1, 1, 1, 1, 1});
  CHECK_THROWS_AS(lin.to(DType::i32), std::invalid_argument);
  lin.to(Device::cpu());  // a no-op that keeps handles
  CHECK(lin.weight().is_same(w));
  Module m;
  Tensor idx = m.register_buffer("idx", zeros({2}, {.dtype = DType::i64}));
  m.to(DType::f64);
  CHECK(idx.dtype() == DType::i64);  // integer buffers are left alone
}

// ---- layers ----

TEST_CASE("Linear computes x w^T + b and inits in PyTorch's ranges") {
  Generator gen(7);
  Linear lin(3, 2, gen);
  CHECK(lin.weight().shape() == Shape{2, 3});
  CHECK(lin.bias().shape() == Shape{2});
  const auto w = lin.weight().to_vector<double>();
  const auto b = lin.bias().to_vector<double>();
  const double bound = 1.0 / std::sqrt(3.0);
  for (double v : w) CHECK(std::abs(v) <= bound);
  for (double v : b) CHECK(std::abs(v) <= bound);
  const std::vector<float> xv{1, 2, 3, -1, 0.5f, 4};
  Tensor y = lin(from_vector(xv, {2, 3}));
  REQUIRE(y.shape() == Shape{2, 2});
  const auto yv = y.to_vector<double>();
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      double ref = b[j];
      for (int k = 0; k < 3; ++k) ref += xv[i * 3 + k] * w[j * 3 + k];
      CHECK(yv[i * 2 + j] == doctest::Approx(ref).epsilon(1e-6));
    }
  // Leading batch dims pass through; no-bias layers have one parameter.
  Linear nb(3, 5, gen, /*bias=*/false);
  CHECK(nb.parameters().size() == 1);
  CHECK_FALSE(nb.bias().defined());
  CHECK(nb(zeros({4, 2, 3})).shape() == Shape{4, 2, 5});
  CHECK(nb(zeros({0, 3})).shape() == Shape{0, 5});
  CHECK_THROWS_WITH_AS(nb(zeros({2, 4})), doctest::Contains("[Linear]"), std::invalid_argument);
  // The same seed gives the same layer.
  Generator g1(99), g2(99);
  CHECK(Linear(4, 4, g1).weight().to_vector<float>() ==
        Linear(4, 4, g2).weight().to_vector<float>());
}

TEST_CASE("Linear's default init has kaiming_uniform(a = sqrt 5) statistics") {
  Generator gen(8);
  Linear lin(400, 300, gen);
  const auto w = lin.weight().to_vector<double>();
  const auto b = lin.bias().to_vector<double>();
  const double bound = 1.0 / std::sqrt(400.0);
  CHECK(vmax(w) <= bound);
  CHECK(vmin(w) >= -bound);
  CHECK(vmax(w) > 0.99 * bound);
  CHECK(vstd(w) == doctest::Approx(bound / std::sqrt(3.0)).epsilon(0.02));
  CHECK(std::abs(vmean(w)) < 0.01 * bound);
  CHECK(vmax(b) <= bound);
  CHECK(vmin(b) >= -bound);
}

TEST_CASE("Conv2d matches an explicit cross-correlation") {
  Generator gen(9);
  Conv2d conv(4, 6, {3, 2}, gen, {.stride = {2, 1}, .padding = {1, 0}, .groups = 2});
  CHECK(conv.weight().shape() == Shape{6, 2, 3, 2});
  const auto w = conv.weight().to_vector<double>();
  const auto b = conv.bias().to_vector<double>();
  const double bound = 1.0 / std::sqrt(2.0 * 3 * 2);
  for (double v : w) CHECK(std::abs(v) <= bound);
  const int64_t N = 2, C = 4, H = 5, W = 4, O = 6, KH = 3, KW = 2;
  Tensor x = randn({N, C, H, W}, gen);
  const auto xv = x.to_vector<double>();
  Tensor y = conv(x);
  const int64_t OH = (H + 2 - KH) / 2 + 1, OW = W - KW + 1;
  REQUIRE(y.shape() == Shape{N, O, OH, OW});
  const auto yv = y.to_vector<double>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double ref = b[o];
          const int64_t g = o / 3;
          for (int64_t c = 0; c < 2; ++c)
            for (int64_t kh = 0; kh < KH; ++kh)
              for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t ih = oh * 2 - 1 + kh, iw = ow + kw;
                if (ih < 0 || ih >= H) continue;
                ref += xv[((n * C + g * 2 + c) * H + ih) * W + iw] *
                       w[((o * 2 + c) * KH + kh) * KW + kw];
              }
          CHECK(yv[((n * O + o) * OH + oh) * OW + ow] == doctest::Approx(ref).epsilon(1e-5));
        }
  CHECK_THROWS_WITH_AS(Conv2d(3, 4, {3, 3}, gen, {.groups = 2}),
                       doctest::Contains("multiples of groups"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv(zeros({1, 3, 5, 5})), doctest::Contains("[Conv2d]"),
                       std::invalid_argument);
  Conv2d nb(1, 1, {1, 1}, gen, {.bias = false});
  CHECK(names(nb.named_parameters()) == std::vector<std::string>{"weight"});
}

TEST_CASE("ConvTranspose2d matches an explicit scatter of the input") {
  Generator gen(10);
  Conv2dOptions o{.stride = {2, 2}, .padding = {1, 0}, .output_padding = {1, 0}};
  ConvTranspose2d conv(3, 2, {3, 2}, gen, o);
  CHECK(conv.weight().shape() == Shape{3, 2, 3, 2});
  // PyTorch takes fan_in from weight dim 1: out_channels / groups * kh * kw.
  const double bound = 1.0 / std::sqrt(2.0 * 3 * 2);
  for (double v : conv.weight().to_vector<double>()) CHECK(std::abs(v) <= bound);
  const int64_t N = 1, C = 3, H = 3, W = 2, O = 2, KH = 3, KW = 2;
  Tensor x = randn({N, C, H, W}, gen);
  Tensor y = conv(x);
  const int64_t OH = (H - 1) * 2 - 2 + (KH - 1) + 1 + 1, OW = (W - 1) * 2 + (KW - 1) + 1;
  REQUIRE(y.shape() == Shape{N, O, OH, OW});
  const auto xv = x.to_vector<double>(), w = conv.weight().to_vector<double>(),
             b = conv.bias().to_vector<double>();
  std::vector<double> ref(static_cast<size_t>(N * O * OH * OW));
  for (int64_t oc = 0; oc < O; ++oc)
    for (int64_t i = 0; i < OH * OW; ++i) ref[oc * OH * OW + i] = b[oc];
  for (int64_t c = 0; c < C; ++c)
    for (int64_t ih = 0; ih < H; ++ih)
      for (int64_t iw = 0; iw < W; ++iw)
        for (int64_t oc = 0; oc < O; ++oc)
          for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw = 0; kw < KW; ++kw) {
              const int64_t oh = ih * 2 - 1 + kh, ow = iw * 2 + kw;
              if (oh < 0 || oh >= OH || ow < 0 || ow >= OW) continue;
              ref[(oc * OH + oh) * OW + ow] +=
                  xv[(c * H + ih) * W + iw] * w[((c * O + oc) * KH + kh) * KW + kw];
            }
  const auto yv = y.to_vector<double>();
  for (size_t i = 0; i < ref.size(); ++i) CHECK(yv[i] == doctest::Approx(ref[i]).epsilon(1e-5));
  CHECK_THROWS_AS(ConvTranspose2d(3, 2, {3, 3}, gen, {.output_padding = {1, 1}}),
                  std::invalid_argument);
  CHECK_THROWS_AS(Conv2d(3, 2, {3, 3}, gen, {.stride = {2, 2}, .output_padding = {1, 1}}),
                  std::invalid_argument);
}

TEST_CASE("Conv2d and ConvTranspose2d with layout nhwc take and give channels last") {
  // Same weights (same generator stream) as the channels-first layer; the
  // activations are the permutation of its.
  for (const bool transposed : {false, true}) {
    CAPTURE(transposed);
    Generator g1(11), g2(11);
    const Conv2dOptions first{.stride = {2, 2}, .padding = {1, 1}};
    Conv2dOptions last = first;
    last.layout = ConvLayout::nhwc;
    std::shared_ptr<Module> a, b;
    if (transposed) {
      a = std::make_shared<ConvTranspose2d>(16, 32, std::array<int64_t, 2>{4, 4}, g1, first);
      b = std::make_shared<ConvTranspose2d>(16, 32, std::array<int64_t, 2>{4, 4}, g2, last);
    } else {
      a = std::make_shared<Conv2d>(16, 32, std::array<int64_t, 2>{4, 4}, g1, first);
      b = std::make_shared<Conv2d>(16, 32, std::array<int64_t, 2>{4, 4}, g2, last);
    }
    const Tensor x = randn({3, 16, 6, 5}, g1);
    const Tensor ya = a->forward(x);
    const Tensor yb = b->forward(contiguous(permute(x, {0, 2, 3, 1})));
    REQUIRE(yb.shape() == Shape{ya.size(0), ya.size(2), ya.size(3), ya.size(1)});
    CHECK(contiguous(permute(yb, {0, 3, 1, 2})).to_vector<double>() == ya.to_vector<double>());
    CHECK_THROWS_WITH_AS(b->forward(x), doctest::Contains("(layout nhwc), got [3, 16, 6, 5]"),
                         std::invalid_argument);
  }
}

TEST_CASE("Embedding looks up rows and zeroes the padding row") {
  Generator gen(11);
  Embedding emb(1000, 64, gen, /*padding_idx=*/2);
  const auto w = emb.weight().to_vector<double>();
  for (int64_t d = 0; d < 64; ++d) CHECK(w[2 * 64 + d] == 0.0);
  std::vector<double> rest(w.begin() + 3 * 64, w.end());
  CHECK(vstd(rest) == doctest::Approx(1.0).epsilon(0.02));
  CHECK(std::abs(vmean(rest)) < 0.02);
  Tensor idx = from_vector<int64_t>({5, 2, 999, 5}, {2, 2});
  Tensor y = emb(idx);
  REQUIRE(y.shape() == Shape{2, 2, 64});
  const auto yv = y.to_vector<double>();
  const int64_t rows[] = {5, 2, 999, 5};
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t d = 0; d < 64; ++d) CHECK(yv[i * 64 + d] == w[rows[i] * 64 + d]);
  CHECK_THROWS_AS(Embedding(4, 2, gen, 4), std::invalid_argument);
}

TEST_CASE("LayerNorm and GroupNorm normalise and apply their affine parameters") {
  const std::vector<double> xv{1, 2, 3, 4, -2, 0, 2, 10};
  Tensor x = from_vector(xv, {2, 4});
  LayerNorm ln({4});
  ln.to(DType::f64);
  CHECK(names(ln.named_parameters()) == std::vector<std::string>{"weight", "bias"});
  {
    NoGradGuard ng;
    fill_(ln.weight(), 2.0);
    fill_(ln.bias(), 0.5);
  }
  const auto y = ln(x).to_vector<double>();
  for (int r = 0; r < 2; ++r) {
    double m = 0, v = 0;
    for (int k = 0; k < 4; ++k) m += xv[r * 4 + k] / 4;
    for (int k = 0; k < 4; ++k) v += (xv[r * 4 + k] - m) * (xv[r * 4 + k] - m) / 4;
    for (int k = 0; k < 4; ++k)
      CHECK(y[r * 4 + k] == doctest::Approx(2.0 * (xv[r * 4 + k] - m) / std::sqrt(v + 1e-5) + 0.5));
  }
  CHECK(LayerNorm({4}, 1e-5, false).parameters().empty());

  // GroupNorm over [1, 4, 2] with 2 groups: channels {0,1} and {2,3}.
  GroupNorm gn(2, 4);
  gn.to(DType::f64);
  CHECK(gn.weight().to_vector<double>() == std::vector<double>{1, 1, 1, 1});
  CHECK(gn.bias().to_vector<double>() == std::vector<double>{0, 0, 0, 0});
  const auto z = gn(from_vector(xv, {1, 4, 2})).to_vector<double>();
  for (int g = 0; g < 2; ++g) {
    double m = 0, v = 0;
    for (int k = 0; k < 4; ++k) m += xv[g * 4 + k] / 4;
    for (int k = 0; k < 4; ++k) v += (xv[g * 4 + k] - m) * (xv[g * 4 + k] - m) / 4;
    for (int k = 0; k < 4; ++k)
      CHECK(z[g * 4 + k] == doctest::Approx((xv[g * 4 + k] - m) / std::sqrt(v + 1e-5)));
  }
  CHECK_THROWS_WITH_AS(GroupNorm(3, 4), doctest::Contains("multiple"), std::invalid_argument);
}

TEST_CASE("Sequential chains its children") {
  Generator gen(12);
  auto l1 = std::make_shared<Linear>(2, 3, gen);
  auto l2 = std::make_shared<Linear>(3, 1, gen);
  Sequential seq(l1, std::make_shared<Tanh>());
  seq.push_back(l2);
  CHECK(seq.size() == 3);
  CHECK(names(seq.named_parameters()) ==
        std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  Tensor x = from_vector<float>({0.5f, -1.0f}, {1, 2});
  CHECK(seq(x).to_vector<float>() == (*l2)(tanh((*l1)(x))).to_vector<float>());
  CHECK_THROWS_AS(seq[3], std::invalid_argument);
  Sequential empty_seq;
  CHECK(empty_seq(x).is_same(x));
}

TEST_CASE("activation modules compute their formulas") {
  const std::vector<double> xv{-2.0, -0.5, 0.0, 0.7, 3.0};
  Tensor x = from_vector(xv);
  auto check = [&](Module&& m, double (*f)(double)) {
    CAPTURE(m.type_name());
    const auto y = m(x).to_vector<double>();
    for (size_t i = 0; i < xv.size(); ++i) CHECK(y[i] == doctest::Approx(f(xv[i])));
  };
  check(ReLU(), [](double v) { return v > 0 ? v : 0.0; });
  check(GELU(), [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); });
  check(GELU(GeluApprox::tanh), [](double v) {
    return 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
  });
  check(SiLU(), [](double v) { return v / (1 + std::exp(-v)); });
  check(Tanh(), [](double v) { return std::tanh(v); });
  check(Sigmoid(), [](double v) { return 1 / (1 + std::exp(-v)); });
  check(LeakyReLU(0.2), [](double v) { return v > 0 ? v : 0.2 * v; });
  check(LeakyReLU(), [](double v) { return v > 0 ? v : 0.01 * v; });
  check(Identity(), [](double v) { return v; });
  CHECK(Flatten()(zeros({2, 3, 4})).shape() == Shape{2, 12});
  CHECK(Flatten(0, 1)(zeros({2, 3, 4})).shape() == Shape{6, 4});
  const Tensor img = from_vector(std::vector<double>{1, 5, 2, 0, 3, 4, 7, 6}, {1, 1, 2, 4});
  CHECK(MaxPool2d({2, 2})(img).to_vector<double>() == std::vector<double>{5, 7});
  CHECK(MaxPool2d({1, 2}, {1, 2})(img).to_vector<double>() == std::vector<double>{5, 2, 4, 7});
  const Tensor up = UpsampleNearest2x()(from_vector(std::vector<double>{1, 2}, {1, 1, 1, 2}));
  CHECK(up.shape() == Shape{1, 1, 2, 4});
  CHECK(up.to_vector<double>() == std::vector<double>{1, 1, 2, 2, 1, 1, 2, 2});
}

// ---- initialisers ----

TEST_CASE("initialisers follow PyTorch's formulas") {
  using namespace quanta::init;
  CHECK(calculate_gain(Nonlinearity::linear) == 1.0);
  CHECK(calculate_gain(Nonlinearity::tanh) == doctest::Approx(5.0 / 3.0));
  CHECK(calculate_gain(Nonlinearity::relu) == doctest::Approx(std::sqrt(2.0)));
  CHECK(calculate_gain(Nonlinearity::leaky_relu, 0.2) == doctest::Approx(std::sqrt(2.0 / 1.04)));
  CHECK(calculate_gain(Nonlinearity::selu) == 0.75);
  CHECK(calculate_fan_in_and_fan_out(zeros({16, 8, 3, 3})) == std::pair<int64_t, int64_t>{72, 144});
  CHECK(calculate_fan_in_and_fan_out(zeros({5, 7})) == std::pair<int64_t, int64_t>{7, 5});
  CHECK_THROWS_WITH_AS(calculate_fan_in_and_fan_out(zeros({5})),
                       doctest::Contains("at least 2 dims"), std::invalid_argument);

  Generator gen(13);
  // Parameters require grad: initialisers run under their own NoGradGuard.
  Tensor w = zeros({256, 512}).requires_grad_();

  kaiming_uniform_(w, gen);  // a = 0: relu gain, fan_in 512
  auto v = w.to_vector<double>();
  double bound = std::sqrt(2.0) * std::sqrt(3.0 / 512);
  CHECK(vmax(v) <= bound);
  CHECK(vmin(v) >= -bound);
  CHECK(vmax(v) > 0.99 * bound);
  CHECK(vstd(v) == doctest::Approx(bound / std::sqrt(3.0)).epsilon(0.02));

  kaiming_uniform_(w, gen, 0.0, FanMode::fan_out, Nonlinearity::tanh);
  v = w.to_vector<double>();
  bound = 5.0 / 3.0 * std::sqrt(3.0 / 256);
  CHECK(vmax(v) <= bound);
  CHECK(vmax(v) > 0.99 * bound);

  kaiming_normal_(w, gen);
  CHECK(vstd(w.to_vector<double>()) == doctest::Approx(std::sqrt(2.0 / 512)).epsilon(0.02));
  kaiming_normal_(w, gen, 0.0, FanMode::fan_out, Nonlinearity::relu);
  CHECK(vstd(w.to_vector<double>()) == doctest::Approx(std::sqrt(2.0 / 256)).epsilon(0.02));

  xavier_uniform_(w, gen, 2.0);
  v = w.to_vector<double>();
  bound = 2.0 * std::sqrt(6.0 / (256 + 512));
  CHECK(vmax(v) <= bound);
  CHECK(vmax(v) > 0.99 * bound);
  CHECK(vstd(v) == doctest::Approx(bound / std::sqrt(3.0)).epsilon(0.02));
  xavier_normal_(w, gen);
  v = w.to_vector<double>();
  CHECK(vstd(v) == doctest::Approx(std::sqrt(2.0 / (256 + 512))).epsilon(0.02));
  CHECK(std::abs(vmean(v)) < 0.002);

  constant_(w, 0.25);
  CHECK(vmin(w.to_vector<double>()) == 0.25);
  CHECK(vmax(w.to_vector<double>()) == 0.25);
  ones_(w);
  CHECK(vmin(w.to_vector<double>()) == 1.0);
  zeros_(w);
  CHECK(vmax(w.to_vector<double>()) == 0.0);
  CHECK(w.requires_grad());
  Tensor empty_w = zeros({0, 4});
  kaiming_uniform_(empty_w, gen);  // zero elements: nothing to do
  // Same generator state, same values.
  Generator a(5), b(5);
  Tensor t1 = zeros({4, 4}), t2 = zeros({4, 4});
  xavier_uniform_(t1, a);
  xavier_uniform_(t2, b);
  CHECK(t1.to_vector<float>() == t2.to_vector<float>());
}

TEST_CASE("forward hooks run around operator() and a ForwardScope, again in a recomputation") {
  Generator gen(3);
  auto lin = std::make_shared<Linear>(3, 2, gen);
  std::vector<std::string> log;
  const int a = lin->add_forward_hooks([&](Module& m) { log.push_back("before " + m.type_name()); },
                                       [&](Module&) { log.push_back("after"); });
  lin->add_forward_hooks(nullptr, [&](Module&) { log.push_back("after 2"); });
  const Tensor x = ones({1, 3}).requires_grad_(true);
  (*lin)(x);
  CHECK(log == std::vector<std::string>{"before Linear", "after 2", "after"});
  // forward() itself runs none; a ForwardScope does.
  log.clear();
  lin->forward(x);
  CHECK(log.empty());
  {
    const Module::ForwardScope scope(*lin);
    CHECK(log == std::vector<std::string>{"before Linear"});
  }
  CHECK(log.size() == 3);
  // recompute runs the forward, and its hooks, again in the backward.
  log.clear();
  sum(recompute(*lin, x)).backward();
  CHECK(std::count(log.begin(), log.end(), "before Linear") == 2);
  // The after hooks run when the forward throws, too.
  log.clear();
  CHECK_THROWS((*lin)(ones({1, 5})));
  CHECK(log == std::vector<std::string>{"before Linear", "after 2", "after"});
  lin->remove_forward_hooks(a);
  lin->remove_forward_hooks(a);  // already gone: nothing
  log.clear();
  (*lin)(x);
  CHECK(log == std::vector<std::string>{"after 2"});
}

namespace {
// Keeps a host copy of its buffer's value, as NF4Linear keeps its offset.
struct HostCopy : Module {
  Tensor value;
  float seen = 0;
  int reads = 0;
  HostCopy() : Module("HostCopy") { value = register_buffer("value", full({1}, 2.5)); }
  void read_host_state() override {
    ++reads;
    seen = float(value.item());
  }
};
}  // namespace

TEST_CASE("buffers away: reload_host_state keeps their state, to() refuses to move them") {
  auto parent = std::make_shared<Sequential>(std::make_shared<HostCopy>());
  auto& m = dynamic_cast<HostCopy&>(*parent->named_children()[0].second);
  copy_(m.value, full({1}, 4.0));
  parent->reload_host_state();
  CHECK(m.reads == 1);
  CHECK(m.seen == 4.0f);
  // Emptied as dist::ShardedUnits empties a unit between its forwards: the
  // bytes are elsewhere, reading them would read nothing.
  const std::shared_ptr<Storage> kept = m.value.storage();
  m.value.impl()->storage = std::make_shared<Storage>(0, Device::cpu());
  parent->reload_host_state();
  CHECK(m.reads == 1);
  CHECK(m.seen == 4.0f);
  // Nor can it be moved or cast while away: refused, naming it.
  CHECK(message_of([&] {
          parent->to(DType::f64);
        }).find("'0.value' holds no bytes here (sharded across ranks, or still in its file)") !=
        std::string::npos);
  CHECK_THROWS_AS(parent->to(Device::sim(0)), std::invalid_argument);
  CHECK(m.value.device() == Device::cpu());
  m.value.impl()->storage = kept;  // back, as a gather brings them
  parent->reload_host_state();
  CHECK(m.reads == 2);
}
