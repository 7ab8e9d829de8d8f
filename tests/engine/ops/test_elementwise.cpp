// Op-harness rows for the elementwise ops, plus the (nd) ops' values.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "engine/cpu/parallel.h"
#include "engine/ops/harness.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

using Scalar1 = std::function<double(double)>;
using Scalar2 = std::function<double(double, double)>;

OpCase unary_case(std::string name, std::function<Tensor(const Tensor&)> op, Scalar1 ref,
                  Domain domain = Domain::any) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = {{3, 4}};
  c.zero_shapes = {{0, 4}};
  c.inputs = {spec(domain)};
  c.op = [op](const Inputs& x) { return op(x[0]); };
  c.reference = [ref](const Inputs& x) {
    return ref_elementwise(x, [ref](const std::vector<double>& v) { return ref(v[0]); });
  };
  return c;
}

OpCase binary_case(std::string name, std::function<Tensor(const Tensor&, const Tensor&)> op,
                   Scalar2 ref, Domain da = Domain::any, Domain db = Domain::any) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = {{3, 4}, {3, 4}};
  c.broadcast_shapes = {{2, 1, 4}, {3, 1}};
  c.zero_shapes = {{0, 4}, {1, 4}};
  c.inputs = {spec(da), spec(db)};
  c.op = [op](const Inputs& x) { return op(x[0], x[1]); };
  c.reference = [ref](const Inputs& x) {
    return ref_elementwise(x, [ref](const std::vector<double>& v) { return ref(v[0], v[1]); });
  };
  return c;
}

double sigmoid_ref(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// erfinv by bisection on std::erf: independent of the kernel's approximation.
double erfinv_ref(double v) {
  double lo = -6, hi = 6;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (std::erf(mid) < v ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

}  // namespace

TEST_CASE("elementwise binary ops through the harness") {
  run_case(binary_case(
      "add", [](auto& a, auto& b) { return add(a, b); }, [](double a, double b) { return a + b; }));
  run_case(binary_case(
      "sub", [](auto& a, auto& b) { return sub(a, b); }, [](double a, double b) { return a - b; }));
  run_case(binary_case(
      "mul", [](auto& a, auto& b) { return mul(a, b); }, [](double a, double b) { return a * b; }));
  run_case(binary_case(
      "div", [](auto& a, auto& b) { return div(a, b); }, [](double a, double b) { return a / b; },
      Domain::any, Domain::away_from_zero));
  run_case(binary_case(
      "pow", [](auto& a, auto& b) { return pow(a, b); },
      [](double a, double b) { return std::pow(a, b); }, Domain::positive));
  run_case(binary_case(
      "maximum", [](auto& a, auto& b) { return maximum(a, b); },
      [](double a, double b) { return std::max(a, b); }));
  run_case(binary_case(
      "minimum", [](auto& a, auto& b) { return minimum(a, b); },
      [](double a, double b) { return std::min(a, b); }));
  run_case(binary_case(
      "operator+scalar", [](auto& a, auto& b) { return a * 2.5 + b - 1.0; },
      [](double a, double b) { return a * 2.5 + b - 1.0; }));
}

TEST_CASE("elementwise unary ops through the harness") {
  run_case(unary_case(
      "neg", [](auto& x) { return neg(x); }, [](double v) { return -v; }));
  run_case(unary_case(
      "abs", [](auto& x) { return abs(x); }, [](double v) { return std::abs(v); },
      Domain::away_from_zero));
  run_case(unary_case(
      "exp", [](auto& x) { return exp(x); }, [](double v) { return std::exp(v); }));
  run_case(unary_case(
      "log", [](auto& x) { return log(x); }, [](double v) { return std::log(v); },
      Domain::positive));
  run_case(unary_case(
      "log1p", [](auto& x) { return log1p(x); }, [](double v) { return std::log1p(v); },
      Domain::positive));
  run_case(unary_case(
      "sqrt", [](auto& x) { return sqrt(x); }, [](double v) { return std::sqrt(v); },
      Domain::positive));
  run_case(unary_case(
      "rsqrt", [](auto& x) { return rsqrt(x); }, [](double v) { return 1 / std::sqrt(v); },
      Domain::positive));
  run_case(unary_case(
      "sin", [](auto& x) { return sin(x); }, [](double v) { return std::sin(v); }));
  run_case(unary_case(
      "cos", [](auto& x) { return cos(x); }, [](double v) { return std::cos(v); }));
  run_case(unary_case(
      "tanh", [](auto& x) { return tanh(x); }, [](double v) { return std::tanh(v); }));
  run_case(unary_case(
      "erf", [](auto& x) { return erf(x); }, [](double v) { return std::erf(v); }));
  run_case(unary_case(
      "erfinv", [](auto& x) { return erfinv(x); }, erfinv_ref, Domain::unit));
  run_case(unary_case(
      "atan", [](auto& x) { return atan(x); }, [](double v) { return std::atan(v); }));
  run_case(unary_case(
      "sigmoid", [](auto& x) { return sigmoid(x); }, sigmoid_ref));
  run_case(unary_case(
      "relu", [](auto& x) { return relu(x); }, [](double v) { return v > 0 ? v : 0; },
      Domain::away_from_zero));
  run_case(unary_case(
      "leaky_relu", [](auto& x) { return leaky_relu(x, 0.2); },
      [](double v) { return v > 0 ? v : 0.2 * v; }, Domain::away_from_zero));
  run_case(unary_case(
      "gelu_erf", [](auto& x) { return gelu(x); },
      [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }));
  run_case(unary_case(
      "gelu_tanh", [](auto& x) { return gelu(x, GeluApprox::tanh); },
      [](double v) {
        return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
      }));
  run_case(unary_case(
      "silu", [](auto& x) { return silu(x); }, [](double v) { return v * sigmoid_ref(v); }));
  run_case(unary_case(
      "softplus", [](auto& x) { return softplus(x, 2.0, 3.0); },
      [](double v) { return 2 * v > 3 ? v : std::log1p(std::exp(2 * v)) / 2; },
      Domain::away_from_zero));
  run_case(unary_case(
      "square", [](auto& x) { return square(x); }, [](double v) { return v * v; }));
  run_case(unary_case(
      "pow_scalar", [](auto& x) { return pow(x, 1.7); }, [](double v) { return std::pow(v, 1.7); },
      Domain::positive));
  run_case(unary_case(
      "pow_scalar_neg", [](auto& x) { return pow(x, -2.0); },
      [](double v) { return std::pow(v, -2.0); }, Domain::positive));
  run_case(unary_case(
      "clamp", [](auto& x) { return clamp(x, -0.5, 0.7); },
      [](double v) { return std::clamp(v, -0.5, 0.7); }));
  run_case(unary_case(
      "clamp_open_low", [](auto& x) { return clamp(x, NAN, 0.7); },
      [](double v) { return std::min(v, 0.7); }));
}

TEST_CASE("clamp with tensor bounds and where through the harness") {
  OpCase c;
  c.name = "clamp_tensor";
  c.shapes = {{3, 4}, {3, 4}, {4}};
  c.broadcast_shapes = {{2, 3, 4}, {3, 1}, {1}};
  c.zero_shapes = {{0, 4}, {1, 4}, {4}};
  c.inputs = {spec(Domain::distinct), spec(Domain::distinct), spec(Domain::distinct)};
  c.op = [](const Inputs& x) { return clamp(x[0], x[1] - 1.0, x[2] + 1.0); };
  c.reference = [](const Inputs& x) {
    return ref_elementwise(x, [](const std::vector<double>& v) {
      return std::min(std::max(v[0], v[1] - 1.0), v[2] + 1.0);
    });
  };
  run_case(c);

  OpCase w;
  w.name = "where";
  w.shapes = {{3, 4}, {3, 4}, {3, 4}};
  w.broadcast_shapes = {{3, 1}, {4}, {2, 1, 1}};
  w.zero_shapes = {{0, 4}, {4}, {1}};
  auto mask = [](const Shape& s, uint64_t seed) {
    return gt(make_input(s, Domain::any, seed), scalar(0.0, {.dtype = DType::f64}));
  };
  w.inputs = {InputSpec{.make = mask, .differentiable = false}, InputSpec{}, InputSpec{}};
  w.op = [](const Inputs& x) { return where(x[0], x[1], x[2]); };
  w.reference = [](const Inputs& x) {
    return ref_elementwise({x[0].to(DType::f64), x[1], x[2]},
                           [](const std::vector<double>& v) { return v[0] != 0 ? v[1] : v[2]; });
  };
  run_case(w);
}

TEST_CASE("non-differentiable elementwise ops give exact values") {
  Tensor x = from_vector<float>({-2.5f, -0.5f, 0.0f, 0.5f, 1.5f, 2.5f, NAN, INFINITY});
  CHECK(round(x).to_vector<float>()[0] == -2.0f);  // half to even
  CHECK(round(x).to_vector<float>()[3] == 0.0f);
  CHECK(round(x).to_vector<float>()[4] == 2.0f);
  CHECK(floor(x).to_vector<float>()[1] == -1.0f);
  CHECK(ceil(x).to_vector<float>()[1] == -0.0f);
  auto s = sign(x).to_vector<float>();
  CHECK(s[0] == -1.0f);
  CHECK(s[2] == 0.0f);
  CHECK(s[5] == 1.0f);
  CHECK(isnan(x).to_vector<bool>() ==
        std::vector<bool>{false, false, false, false, false, false, true, false});
  CHECK(isfinite(x).to_vector<bool>() ==
        std::vector<bool>{true, true, true, true, true, true, false, false});
  Tensor a = from_vector<int64_t>({1, 2, 3}), b = from_vector<int64_t>({3, 2, 1});
  CHECK(lt(a, b).to_vector<bool>() == std::vector<bool>{true, false, false});
  CHECK(le(a, b).to_vector<bool>() == std::vector<bool>{true, true, false});
  CHECK(eq(a, b).to_vector<bool>() == std::vector<bool>{false, true, false});
  CHECK(ne(a, b).to_vector<bool>() == std::vector<bool>{true, false, true});
  CHECK(gt(a, b).to_vector<bool>() == std::vector<bool>{false, false, true});
  CHECK(ge(a, b).to_vector<bool>() == std::vector<bool>{false, true, true});
  Tensor p = from_vector<bool>({true, true, false, false}),
         q = from_vector<bool>({true, false, true, false});
  CHECK(logical_and(p, q).to_vector<bool>() == std::vector<bool>{true, false, false, false});
  CHECK(logical_or(p, q).to_vector<bool>() == std::vector<bool>{true, true, true, false});
  CHECK(logical_xor(p, q).to_vector<bool>() == std::vector<bool>{false, true, true, false});
  CHECK(logical_not(p).to_vector<bool>() == std::vector<bool>{false, false, true, true});
  CHECK_FALSE(round(from_vector<double>({1.2}).requires_grad_()).requires_grad());
}

TEST_CASE("dtype promotion and integer arithmetic") {
  Tensor i = from_vector<int32_t>({1, 2, 3});
  Tensor l = from_vector<int64_t>({10, 20, 30});
  CHECK(add(i, l).dtype() == DType::i64);
  CHECK(add(i, l).to_vector<int64_t>() == std::vector<int64_t>{11, 22, 33});
  CHECK((i * 2.0).dtype() == DType::i32);
  CHECK((i * 2.5).dtype() == DType::f32);
  CHECK(div(i, i).dtype() == DType::f32);  // true division
  CHECK(exp(i).dtype() == DType::f32);
  Tensor h = from_vector<float>({1.5f, 2.5f}).to(DType::bf16);
  Tensor hs = add(h, h);
  CHECK(hs.dtype() == DType::bf16);
  CHECK(hs.to_vector<float>() == std::vector<float>{3.0f, 5.0f});
  CHECK(add(h, from_vector<float>({1, 1}).to(DType::f16)).dtype() == DType::f32);
  CHECK_THROWS_WITH_AS(add(from_vector<float>({1, 2, 3}), from_vector<float>({1, 2})),
                       doctest::Contains("[add] shapes [3] and [2] cannot be broadcast"),
                       std::invalid_argument);
}

TEST_CASE("in-place updates refuse tensors that require grad") {
  Tensor w = from_vector<float>({1, 2}).requires_grad_();
  CHECK_THROWS_WITH_AS(add_(w, ones({2})), doctest::Contains("[add_] in-place"),
                       std::invalid_argument);
  {
    NoGradGuard ng;
    add_(w, ones({2}), 0.5);
    addcmul_(w, ones({2}), full({2}, 2.0), 0.25);
    addcdiv_(w, ones({2}), full({2}, 4.0), 1.0);
    mul_(w, 2.0);
  }
  CHECK(w.to_vector<float>() == std::vector<float>{4.5f, 6.5f});
}

TEST_CASE("div_ divides in place, broadcasting, bit for bit as div") {
  Generator gen(8);
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    const Tensor a = to_dtype(randn({37, 19}, gen), dt);
    const Tensor b = to_dtype(add(rand({37, 1}, gen), scalar(0.5)), dt);
    const Tensor expected = div(a, b);
    const Tensor d = a.clone();
    div_(d, b);
    CHECK(d.to_vector<double>() == expected.to_vector<double>());
  }
  const Tensor w = from_vector<float>({1, 2}).requires_grad_();
  CHECK_THROWS_WITH_AS(div_(w, ones({2})), doctest::Contains("[div_] in-place"),
                       std::invalid_argument);
}

TEST_CASE("straight_through: value of q, identity gradient to x, none to q") {
  Tensor x = from_vector<double>({0.3, -1.2, 2.0}).requires_grad_();
  Tensor q = from_vector<double>({0.0, -1.0, 2.5}).requires_grad_();
  Tensor y = straight_through(x, q);
  CHECK(y.to_vector<double>() == std::vector<double>{0.3 + (0.0 - 0.3), -1.2 + (-1.0 + 1.2), 2.5});
  sum(y * from_vector<double>({1, 2, 3})).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 2, 3});
  CHECK_FALSE(q.grad().defined());
}

TEST_CASE("exp underflows to exactly 0 and keeps inf and NaN, in f32 and f64") {
  // Long enough for the vectorised path; -inf must give 0, not a denormal.
  const std::vector<double> in{-INFINITY, -1000, -800, -120, 0, INFINITY, NAN, 1, -INFINITY};
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    const Tensor y = to_dtype(exp(to_dtype(from_vector<double>(in, {9}), dt)), DType::f64);
    const Tensor c = contiguous(y);
    const double* v = c.data<double>();
    CHECK(v[0] == 0.0);
    CHECK(v[1] == 0.0);
    CHECK(v[2] == 0.0);
    if (dt == DType::f32) CHECK(v[3] == 0.0);  // below log(denorm_min) of float
    CHECK(v[4] == 1.0);
    CHECK(v[5] == INFINITY);
    CHECK(std::isnan(v[6]));
    CHECK(v[7] == doctest::Approx(std::exp(1.0)).epsilon(1e-6));
    CHECK(v[8] == 0.0);
  }
}

TEST_CASE("broadcast inputs: a value splat everywhere or along rows, any position, large sizes") {
  // Sizes past one thread's grain and one 256-element splat block, so the
  // flat broadcast path, its blocks and the per-row splat path all run.
  Generator gen(41);
  const int64_t rows = 300, cols = 700;
  const Tensor a = randn({rows, cols}, gen, {.dtype = DType::f64});
  const Tensor s = from_vector<double>({2.5});
  const Tensor everywhere = expand(reshape(s, {1, 1}), {rows, cols});
  const Tensor col = randn({rows, 1}, gen, {.dtype = DType::f64});
  const Tensor along = expand(col, {rows, cols});
  const auto av = a.to_vector<double>(), cv = col.to_vector<double>();
  const auto left = (everywhere - a).to_vector<double>(),
             right = (a - everywhere).to_vector<double>();
  const auto rowwise = (a * along).to_vector<double>(),
             rowwise_left = (along / a).to_vector<double>();
  std::vector<double> want_left, want_right, want_rowwise, want_rowwise_left;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double x = av[size_t(i)], c = cv[size_t(i / cols)];
    want_left.push_back(2.5 - x);
    want_right.push_back(x - 2.5);
    want_rowwise.push_back(x * c);
    want_rowwise_left.push_back(c / x);
  }
  CHECK(left == want_left);
  CHECK(right == want_right);
  CHECK(rowwise == want_rowwise);
  CHECK(rowwise_left == want_rowwise_left);
  // Mixed dtypes and a bool mask broadcast the same way.
  const Tensor m = expand(scalar(1.0, {.dtype = DType::boolean}), {rows, cols});
  CHECK(where(m, a, zeros_like(a)).to_vector<double>() == av);
  const Tensor i32 = expand(scalar(3.0, {.dtype = DType::i32}), {rows, cols});
  CHECK((a * i32).to_vector<double>() == (a * 3.0).to_vector<double>());
}

TEST_CASE("add_n through the harness (fused path, broadcasting fallback, zero size)") {
  OpCase c;
  c.name = "add_n";
  c.shapes = {{3, 4}, {3, 4}, {3, 4}, {3, 4}};
  c.broadcast_shapes = {{2, 1, 4}, {3, 1}, {4}, {1}};
  c.zero_shapes = {{0, 4}, {0, 4}, {0, 4}, {0, 4}};
  c.inputs = {InputSpec{}, InputSpec{}, InputSpec{}, InputSpec{}};
  c.op = [](const Inputs& x) { return add_n(x); };
  c.reference = [](const Inputs& x) {
    return ref_elementwise(x,
                           [](const std::vector<double>& v) { return v[0] + v[1] + v[2] + v[3]; });
  };
  run_case(c);
}

TEST_CASE("add_n: the chain of adds bit for bit, gradients only where taken, clear errors") {
  Generator gen(8);
  std::vector<Tensor> t;
  for (int i = 0; i < 5; ++i) t.push_back(randn({37, 1000}, gen));  // past one thread's grain
  Tensor chain = t[0];
  for (int i = 1; i < 5; ++i) chain = chain + t[i];
  CHECK(add_n(t).to_vector<float>() == chain.to_vector<float>());
  // A transposed (non-contiguous) term is read through its strides.
  std::vector<Tensor> mixed = {t[0], transpose(randn({1000, 37}, gen), 0, 1), t[1]};
  CHECK(add_n(mixed).to_vector<float>() == (mixed[0] + mixed[1] + mixed[2]).to_vector<float>());
  Tensor a = t[0].clone().requires_grad_(), b = t[1].clone();
  Tensor c = t[2].clone().requires_grad_();
  sum(add_n({a, b, c}) * 3.0).backward();
  CHECK(a.grad().to_vector<float>() == std::vector<float>(37 * 1000, 3.0f));
  CHECK(c.grad().to_vector<float>() == std::vector<float>(37 * 1000, 3.0f));
  CHECK(add_n({t[3]}).to_vector<float>() == t[3].to_vector<float>());
  CHECK_THROWS_WITH_AS(add_n({}), doctest::Contains("[add_n] needs at least one term"),
                       std::invalid_argument);
}

TEST_CASE("add_n on every test device: more terms than one CUDA launch takes, the CPU's bits") {
  Generator gen(9);
  std::vector<Tensor> t;
  for (int i = 0; i < 19; ++i) t.push_back(randn({5, 301}, gen, {.dtype = DType::f64}));
  const std::vector<double> want = add_n(t).to_vector<double>();
  Tensor chain = t[0];
  for (int i = 1; i < 19; ++i) chain = chain + t[i];
  CHECK(want == chain.to_vector<double>());
  for (const Device d : testing::test_devices()) {
    INFO(d.str());
    std::vector<Tensor> on;
    for (const Tensor& x : t) on.push_back(x.to(d));
    const Tensor got = add_n(on);
    CHECK(got.device() == d);
    // The terms may go (and be freed) before the queued kernel runs.
    on.clear();
    CHECK(got.to(Device::cpu()).to_vector<double>() == want);
  }
}

TEST_CASE("relu_backward: where(x > 0, grad, 0) in one pass, NaN and ties included") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = from_vector<double>({-1.0, 0.0, 2.0, nan, 3.0, -0.0}, {2, 3});
  const Tensor g = from_vector<double>({1.0, 2.0, 3.0, 4.0, nan, 6.0}, {2, 3}).requires_grad_();
  const Tensor out = relu_backward(g, x);
  const std::vector<double> v = out.to_vector<double>();
  CHECK(v[0] == 0.0);
  CHECK(v[1] == 0.0);
  CHECK(v[2] == 3.0);
  CHECK(v[3] == 0.0);       // a NaN input passes nothing
  CHECK(std::isnan(v[4]));  // a NaN gradient where the input is positive passes
  CHECK(v[5] == 0.0);
  // Broadcast over rows, f32 like the f64 result.
  const Tensor row = from_vector<float>({1.0f, -1.0f, 0.5f}, {3});
  CHECK(relu_backward(ones({2, 3}), row).to_vector<float>() ==
        std::vector<float>{1, 0, 1, 1, 0, 1});
  // Linear in grad: its gradient is the same mask.
  sum(relu_backward(g, x) * 2.0).backward();
  CHECK(g.grad().to_vector<double>() == std::vector<double>{0, 0, 2, 0, 2, 0});
}

TEST_CASE("erfinv: the ends and outside of [-1, 1], and full precision in f64") {
  const Tensor x = from_vector<double>({1.0, -1.0, 1.5, 0.0, 0.999999, -0.3}, {6});
  const auto y = erfinv(x).to_vector<double>();
  CHECK(std::isinf(y[0]));
  CHECK(y[0] > 0);
  CHECK(std::isinf(y[1]));
  CHECK(y[1] < 0);
  CHECK(std::isnan(y[2]));
  CHECK(y[3] == 0.0);
  CHECK(std::abs(std::erf(y[4]) - 0.999999) < 1e-15);  // erf is flat there: check its value
  CHECK(std::abs(std::erf(y[5]) + 0.3) < 1e-15);
}

TEST_CASE("sigmoid and silu: the vector forms agree with their scalar formulas everywhere") {
  // Every layout takes Eigen's vector exp; the scalar formulas (libm's exp in
  // the tensor's dtype) are the reference, over a grid from -1000 to 1000
  // with the infinities.
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dt);
    std::vector<double> v;
    for (double x = -1000; x <= 1000; x += 0.37) v.push_back(x);
    for (double x = -30; x <= 30; x += 0.001) v.push_back(x);
    v.push_back(std::numeric_limits<double>::infinity());
    v.push_back(-std::numeric_limits<double>::infinity());
    v.push_back(0.0);
    const int64_t n = static_cast<int64_t>(v.size());
    const Tensor dense = from_vector(v, {n}).to(dt);
    const std::vector<double> held = dense.to_vector<double>();
    // The scalar formula in the dtype's own arithmetic.
    const auto scalar = [dt](double x, bool is_silu) {
      const auto in = [&](auto t) {
        using T = decltype(t);
        const T s =
            x >= 0 ? T(1) / (T(1) + std::exp(-T(x))) : std::exp(T(x)) / (T(1) + std::exp(T(x)));
        return static_cast<double>(is_silu ? T(x) / (T(1) + std::exp(-T(x))) : s);
      };
      return dt == DType::f32 ? in(0.0f) : in(0.0);
    };
    const double tol = dt == DType::f32 ? 4e-7 : 1e-15;
    const double tiny = dt == DType::f32 ? 1e-28 : 1e-290;
    for (const bool is_silu : {false, true}) {
      CAPTURE(is_silu);
      const std::vector<double> fast = (is_silu ? silu(dense) : sigmoid(dense)).to_vector<double>();
      std::vector<double> slow(held.size());
      for (size_t i = 0; i < held.size(); ++i) slow[i] = scalar(held[i], is_silu);
      double worst = 0;
      bool same_specials = true;
      for (size_t i = 0; i < v.size(); ++i) {
        if (std::isnan(slow[i]) || std::isinf(slow[i]) || slow[i] == 0) {
          same_specials =
              same_specials && (std::isnan(slow[i]) ? std::isnan(fast[i]) : fast[i] == slow[i]);
          continue;
        }
        // Relative error, except where the result is near the subnormals
        // (sigmoid below -87 in f32, -708 in f64; silu's exp overflowing a
        // hair earlier): there the two exps round apart by a few units of
        // the smallest normal.
        worst = std::max(worst, std::abs(fast[i] - slow[i]) / (std::abs(slow[i]) + tiny));
      }
      CHECK(worst < tol);
      CHECK(same_specials);
    }
  }
}

namespace {

// Bit equality with NaN equal to NaN (the values of a 16-bit tensor as f64).
bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const auto va = a.to(Device::cpu()).to_vector<double>();
  const auto vb = b.to(Device::cpu()).to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i)
    if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i])))) return false;
  return true;
}

// Bit equality, NaN equal to NaN (of any payload).
template <class T>
bool same_bits(T a, T b) {
  return a == b ? std::signbit(a) == std::signbit(b) : std::isnan(a) && std::isnan(b);
}

using UnaryFn = std::function<Tensor(const Tensor&)>;

// The unary ops by name, each with an Eigen vector form or a scalar one.
const std::vector<std::pair<const char*, UnaryFn>>& unary_ops() {
  static const std::vector<std::pair<const char*, UnaryFn>> ops = {
      {"neg", [](const Tensor& x) { return neg(x); }},
      {"abs", [](const Tensor& x) { return abs(x); }},
      {"exp", [](const Tensor& x) { return exp(x); }},
      {"log", [](const Tensor& x) { return log(x); }},
      {"log1p", [](const Tensor& x) { return log1p(x); }},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }},
      {"sin", [](const Tensor& x) { return sin(x); }},
      {"cos", [](const Tensor& x) { return cos(x); }},
      {"tanh", [](const Tensor& x) { return tanh(x); }},
      {"erf", [](const Tensor& x) { return erf(x); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }},
      {"relu", [](const Tensor& x) { return relu(x); }},
      {"leaky_relu", [](const Tensor& x) { return leaky_relu(x, 0.2); }},
      {"gelu", [](const Tensor& x) { return gelu(x); }},
      {"silu", [](const Tensor& x) { return silu(x); }},
      {"softplus", [](const Tensor& x) { return softplus(x); }},
      {"square", [](const Tensor& x) { return square(x); }},
      {"pow 1.5", [](const Tensor& x) { return pow(x, 1.5); }}};
  return ops;
}

}  // namespace

TEST_CASE("unary ops: a value's bits follow the value alone, not its address, layout or threads") {
  // Eigen's vector forms and libm differ in the last bits; an element must
  // get the same bits wherever it lies: at any offset from an aligned
  // address, in a strided tensor, at any place in a thread's piece. And sqrt
  // and rsqrt are correctly rounded (Eigen's fast forms refined the CPU's
  // rsqrt estimate, whose bits differ between Intel's and AMD's chips).
  const int before = num_threads();
  for (const DType dt : {DType::f32, DType::f64}) {
    // 100003 values, positive and negative (log's NaNs included): several
    // threads' pieces and odd tails.
    constexpr int64_t n = 100003;
    const Tensor x = (make_input({n}, Domain::any, 81) * 3.0).to(dt);
    // Leading values for views of x at 1 to 17 values from an allocation's
    // start.
    const Tensor lead = make_input({17}, Domain::any, 82).to(dt);
    const Tensor strided = select(stack({x, x}, 1), 1, 1);
    REQUIRE(!strided.is_contiguous());
    for (const auto& [name, f] : unary_ops()) {
      const std::string at = std::string(dtype_name(dt)) + " " + name;
      INFO(at);
      set_num_threads(1);
      const Tensor want = f(x);
      CHECK(same_values(f(strided), want));
      for (const int threads : {2, 3, 7}) {
        set_num_threads(threads);
        CHECK(same_values(f(x), want));
      }
      set_num_threads(before);
      for (int64_t off = 1; off <= 17; ++off)
        CHECK(same_values(f(narrow(cat({narrow(lead, 0, 0, off), x}), 0, off, n)), want));
    }
    const std::vector<double> v = x.to_vector<double>();
    const std::vector<double> root = sqrt(x).to_vector<double>();
    const std::vector<double> inv_root = rsqrt(x).to_vector<double>();
    bool exact = true;
    for (size_t i = 0; i < v.size(); ++i) {
      if (dt == DType::f32) {
        const float r = std::sqrt(static_cast<float>(v[i]));
        exact = exact && same_bits(static_cast<float>(root[i]), r) &&
                same_bits(static_cast<float>(inv_root[i]), 1.0f / r);
      } else {
        exact = exact && same_bits(root[i], std::sqrt(v[i])) &&
                same_bits(inv_root[i], 1.0 / std::sqrt(v[i]));
      }
    }
    CHECK(exact);
  }
}

TEST_CASE("bf16 and f16 elementwise ops run in one pass with the bits of widening to f32") {
  // Every device's table takes 16-bit operands directly (half_elementwise):
  // each element computed in f32 and rounded once. The reference is the
  // f32 op of the widened operands, narrowed: the same bits by the table's
  // contract, for contiguous, transposed and broadcast operands.
  using Bin = std::function<Tensor(const Tensor&, const Tensor&)>;
  const std::vector<std::pair<const char*, Bin>> binary = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(abs(a), b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
      {"eq", [](const Tensor& a, const Tensor& b) { return eq(a, round(b)); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); }}};
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : quanta::testing::test_devices()) devices.push_back(d);
  for (const Device dev : devices) {
    for (const DType dt : {DType::bf16, DType::f16}) {
      const std::string at = dev.str() + " " + dtype_name(dt);
      INFO(at);
      // 40000 values (several threads' pieces, odd tails), negatives and a
      // few NaN, zeros and infinities included.
      std::vector<double> v = make_input({200, 200}, Domain::any, 71).to_vector<double>();
      for (size_t i = 0; i < v.size(); i += 997) v[i] = NAN;
      for (size_t i = 3; i < v.size(); i += 1999) v[i] = 0;
      for (size_t i = 5; i < v.size(); i += 3001) v[i] = i % 2 ? INFINITY : -INFINITY;
      const Tensor x = from_vector<double>(v, {200, 200}).to(dt).to(dev);
      const Tensor y = make_input({200, 200}, Domain::any, 72).to(dt).to(dev);
      const Tensor row = make_input({1, 200}, Domain::any, 73).to(dt).to(dev);
      const auto wide = [](const Tensor& t) { return t.to(DType::f32); };
      for (const auto& [name, f] : unary_ops()) {
        const std::string op = name;
        INFO(op);
        CHECK(f(x).dtype() == dt);
        CHECK(same_values(f(x), f(wide(x)).to(dt)));
        const Tensor xt = transpose(x, 0, 1);
        CHECK(same_values(f(xt), f(wide(xt)).to(dt)));
      }
      for (const auto& [name, f] : binary) {
        const std::string op = name;
        INFO(op);
        CHECK(same_values(f(x, y), f(wide(x), wide(y)).to(f(x, y).dtype())));
        CHECK(same_values(f(transpose(x, 0, 1), row),
                          f(wide(transpose(x, 0, 1)), wide(row)).to(f(x, row).dtype())));
      }
      // In place: dst = f(dst, src) with src of dst's dtype, broadcast too;
      // each step against the f32 update of the widened values.
      Tensor d16 = contiguous(x * 1.0);
      using Upd = std::function<void(const Tensor&, const Tensor&)>;
      const std::vector<std::tuple<const char*, Upd, Tensor>> updates = {
          {"add_", [](const Tensor& d, const Tensor& s) { add_(d, s, 0.5); }, y},
          {"mul_", [](const Tensor& d, const Tensor& s) { mul_(d, s); }, row},
          {"div_", [](const Tensor& d, const Tensor& s) { div_(d, s); }, y}};
      for (const auto& [name, f, src] : updates) {
        const std::string op = name;
        INFO(op);
        Tensor d32 = wide(d16);
        f(d16, src);
        f(d32, wide(src));
        CHECK(same_values(d16, d32.to(dt)));
      }
    }
  }
  // One pass: an op on 16-bit tensors records one kernel, as on f32 (a
  // widened op would record two conversions more).
  for (const DType dt : {DType::bf16, DType::f16, DType::f32}) {
    INFO(std::string(dtype_name(dt)));
    const Tensor a = ones({64, 64}, {.dtype = dt, .device = Device::sim(0)});
    Tensor out;
    const auto g = DeviceGraph::capture(Device::sim(0), [&] { out = exp(a); });
    CHECK(g.recorded_work() == 1);
    const auto g2 = DeviceGraph::capture(Device::sim(0), [&] { out = add(a, a); });
    CHECK(g2.recorded_work() == 1);
    const auto g3 = DeviceGraph::capture(Device::sim(0), [&] { add_(a, a); });
    CHECK(g3.recorded_work() == 1);
  }
}

TEST_CASE("logical ops read bool operands as they are, numbers as != 0") {
  for (const Device dev : cpu_and_test_devices()) {
    INFO(dev.str());
    const Tensor p = from_vector<bool>({true, true, false, false}).to(dev);
    const Tensor q = from_vector<bool>({true, false, true, false}).to(dev);
    const Tensor n =
        from_vector<float>({-2.5f, 0.0f, 3.0f, 0.0f}).to(dev);  // true false true false
    CHECK(logical_and(p, q).to(Device::cpu()).to_vector<bool>() ==
          std::vector<bool>{true, false, false, false});
    CHECK(logical_xor(p, n).to(Device::cpu()).to_vector<bool>() ==
          std::vector<bool>{false, true, true, false});
    // A strided bool operand: q's transpose [[T, T], [F, F]].
    CHECK(logical_or(reshape(n, {2, 2}), transpose(reshape(q, {2, 2}), 0, 1))
              .to(Device::cpu())
              .to_vector<bool>() == std::vector<bool>{true, true, true, false});
    CHECK(logical_and(p, q).dtype() == DType::boolean);
  }
  // Two bool operands: the one kernel, no converting copies.
  const Tensor p = ones({64}, {.dtype = DType::boolean, .device = Device::sim(0)});
  Tensor out;
  CHECK(DeviceGraph::capture(Device::sim(0), [&] { out = logical_and(p, p); }).recorded_work() ==
        1);
}
