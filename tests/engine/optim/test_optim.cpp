// Optimisers against PyTorch's update formulas written out by hand, gradient
// clipping, learning-rate schedules, and state dict round trips.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <numbers>

#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;

namespace {

Tensor param(const std::vector<double>& v) { return from_vector(v).requires_grad_(); }
void grad(const Tensor& p, const std::vector<double>& g) { p.set_grad(from_vector(g)); }
std::vector<double> val(const Tensor& t) { return t.to_vector<double>(); }

void check_close(const std::vector<double>& got, const std::vector<double>& want,
                 double eps = 1e-12) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(eps));
  }
}

std::vector<std::string> names(const StateDict& sd) {
  std::vector<std::string> out;
  for (const auto& [n, t] : sd) out.push_back(n);
  return out;
}

StateDict snapshot(const StateDict& sd) {
  StateDict out;
  for (const auto& [k, v] : sd) out.emplace_back(k, v.clone());
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// PyTorch's Adam / AdamW for one scalar, written out step by step.
struct AdamRef {
  double p, m = 0, v = 0, vmax = 0;
  int t = 0;
  void step(double g, double lr, double b1, double b2, double eps, double wd, bool amsgrad,
            bool decoupled) {
    ++t;
    if (decoupled)
      p = p * (1 - lr * wd);
    else
      g = g + wd * p;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    vmax = std::max(vmax, v);
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    const double second = amsgrad ? vmax : v;
    p = p - lr / bc1 * m / (std::sqrt(second) / std::sqrt(bc2) + eps);
  }
};

}  // namespace

// ---- SGD ----

TEST_CASE("SGD without momentum: p -= lr * g") {
  Tensor p = param({1.0, 2.0});
  SGD opt({p}, {.lr = 0.1});
  grad(p, {0.1, -0.2});
  opt.step();
  check_close(val(p), {1.0 - 0.1 * 0.1, 2.0 + 0.1 * 0.2});  // 0.99, 2.02
  CHECK(p.requires_grad());
  CHECK(p.is_leaf());
  // The gradient is left as it was; zero_grad drops it.
  check_close(val(p.grad()), {0.1, -0.2});
  opt.zero_grad();
  CHECK_FALSE(p.grad().defined());
  opt.step();  // no gradient: nothing moves
  check_close(val(p), {0.99, 2.02});
}

TEST_CASE("SGD with momentum, dampening and weight decay, several steps") {
  Tensor p = param({1.0, -1.0});
  SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01});
  const double g[3][2] = {{0.5, 0.2}, {-0.3, 0.4}, {0.2, -0.1}};
  double ref[2] = {1.0, -1.0}, buf[2] = {0, 0};
  for (int s = 0; s < 3; ++s) {
    grad(p, {g[s][0], g[s][1]});
    opt.step();
    for (int i = 0; i < 2; ++i) {
      const double d = g[s][i] + 0.01 * ref[i];
      buf[i] = s == 0 ? d : 0.9 * buf[i] + (1 - 0.1) * d;
      ref[i] -= 0.1 * buf[i];
    }
    check_close(val(p), {ref[0], ref[1]});
  }
  // First step by hand: d = 0.5 + 0.01 = 0.51, p = 1 - 0.051.
  Tensor q = param({1.0});
  SGD one({q}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01});
  grad(q, {0.5});
  one.step();
  check_close(val(q), {0.949});
  grad(q, {-0.3});
  one.step();
  // d = -0.3 + 0.00949, buf = 0.9 * 0.51 + 0.9 * d, p = 0.949 - 0.1 buf.
  check_close(val(q), {0.949 - 0.1 * (0.9 * 0.51 + 0.9 * (-0.3 + 0.00949))});
}

TEST_CASE("SGD with Nesterov momentum") {
  Tensor p = param({1.0});
  SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  grad(p, {0.5});
  opt.step();
  // buf = 0.5, d = 0.5 + 0.9 * 0.5 = 0.95.
  check_close(val(p), {1.0 - 0.1 * 0.95});
  grad(p, {-0.3});
  opt.step();
  // buf = 0.9 * 0.5 - 0.3 = 0.15, d = -0.3 + 0.9 * 0.15 = -0.165.
  check_close(val(p), {0.905 + 0.1 * 0.165});
  CHECK_THROWS_WITH_AS(SGD({p}, {.momentum = 0.0, .nesterov = true}), doctest::Contains("nesterov"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(SGD({p}, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}),
                       doctest::Contains("dampening 0"), std::invalid_argument);
}

TEST_CASE("parameter groups have their own lr and weight decay") {
  Tensor a = param({1.0}), b = param({2.0});
  SGD opt(std::vector<ParamGroup>{{.params = {a}, .lr = 0.1}, {.params = {b}, .weight_decay = 0.5}},
          {.lr = 0.01});
  CHECK(*opt.param_groups()[0].weight_decay == 0.0);
  CHECK(*opt.param_groups()[1].lr == 0.01);
  grad(a, {1.0});
  grad(b, {1.0});
  opt.step();
  check_close(val(a), {1.0 - 0.1 * 1.0});
  check_close(val(b), {2.0 - 0.01 * (1.0 + 0.5 * 2.0)});
  CHECK(opt.lr() == 0.1);
  opt.set_lr(0.5);
  CHECK(*opt.param_groups()[1].lr == 0.5);
  Tensor c = param({0.0});
  opt.add_param_group({.params = {c}});
  CHECK(*opt.param_groups()[2].lr == 0.01);
  CHECK_THROWS_WITH_AS(opt.add_param_group({.params = {a}}), doctest::Contains("more than once"),
                       std::invalid_argument);
}

TEST_CASE("optimisers validate their parameters and settings") {
  Tensor p = param({1.0});
  CHECK_THROWS_WITH_AS(SGD({p, p}), doctest::Contains("more than once"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(SGD({p}, {.lr = -1.0}), doctest::Contains("lr must be >= 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(Adam({p}, {.betas = {1.0, 0.999}}), doctest::Contains("beta1"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(SGD({p * 2.0}), doctest::Contains("not a leaf"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(SGD({zeros({1}, {.dtype = DType::i64})}), doctest::Contains("i64"),
                       std::invalid_argument);
}

// ---- Adam / AdamW ----

TEST_CASE("Adam's first step moves by lr in the gradient's sign") {
  Tensor p = param({1.0, -2.0});
  Adam opt({p}, {.lr = 0.1});
  grad(p, {0.5, -4.0});
  opt.step();
  // m = 0.1 g, v = 0.001 g^2; m / bc1 = g, sqrt(v / bc2) = |g|.
  check_close(val(p), {1.0 - 0.1 * 0.5 / (0.5 + 1e-8), -2.0 + 0.1 * 4.0 / (4.0 + 1e-8)});
}

TEST_CASE("Adam, Adam with L2, AdamW and AMSGrad over several steps") {
  const std::vector<std::vector<double>> gs = {{0.5, -1.0}, {0.1, 0.3}, {-0.2, 0.01}, {0.05, 0.02}};
  struct Case {
    const char* name;
    double wd;
    bool amsgrad, decoupled;
  };
  for (const Case c : {Case{"adam", 0.0, false, false}, Case{"adam_l2", 0.1, false, false},
                       Case{"adamw", 0.1, false, true}, Case{"amsgrad", 0.0, true, false},
                       Case{"adamw_amsgrad", 0.05, true, true}}) {
    CAPTURE(c.name);
    const double lr = 0.01, b1 = 0.8, b2 = 0.95, eps = 1e-6;
    Tensor p = param({1.0, -2.0});
    std::unique_ptr<Optimizer> opt;
    if (c.decoupled)
      opt = std::make_unique<AdamW>(
          std::vector<Tensor>{p},
          AdamWOptions{
              .lr = lr, .betas = {b1, b2}, .eps = eps, .weight_decay = c.wd, .amsgrad = c.amsgrad});
    else
      opt = std::make_unique<Adam>(
          std::vector<Tensor>{p},
          AdamOptions{
              .lr = lr, .betas = {b1, b2}, .eps = eps, .weight_decay = c.wd, .amsgrad = c.amsgrad});
    AdamRef ref[2] = {{1.0}, {-2.0}};
    for (const auto& g : gs) {
      grad(p, g);
      opt->step();
      for (int i = 0; i < 2; ++i) ref[i].step(g[i], lr, b1, b2, eps, c.wd, c.amsgrad, c.decoupled);
      check_close(val(p), {ref[0].p, ref[1].p});
    }
  }
}

TEST_CASE("AdamW decays the weight before the Adam step") {
  Tensor p = param({2.0});
  AdamW opt({p}, {.lr = 0.1, .weight_decay = 0.5});
  grad(p, {1.0});
  opt.step();
  // p = 2 (1 - 0.05) = 1.9, then the Adam step of 0.1 / (1 + 1e-8).
  check_close(val(p), {1.9 - 0.1 * 1.0 / (1.0 + 1e-8)});
}

TEST_CASE("AMSGrad keeps the largest second moment") {
  Tensor p = param({0.0});
  Adam opt({p}, {.lr = 1.0, .betas = {0.0, 0.5}, .eps = 0.0, .amsgrad = true});
  grad(p, {2.0});
  opt.step();  // m = 2, v = 2, bc2 = 0.5: denom = sqrt(2 / 0.5) = 2 -> p = -1
  check_close(val(p), {-1.0});
  grad(p, {1.0});
  opt.step();  // m = 1, v = 1.5 < vmax = 2, bc2 = 0.75: denom = sqrt(2 / 0.75)
  check_close(val(p), {-1.0 - 1.0 / std::sqrt(2.0 / 0.75)});
}

TEST_CASE("parameters without a gradient are skipped and keep their state") {
  Tensor a = param({1.0}), b = param({1.0});
  Adam opt({a, b}, {.lr = 0.1});
  grad(a, {1.0});
  opt.step();
  CHECK(val(b) == std::vector<double>{1.0});
  StateDict sd = opt.state_dict();
  CHECK(find_tensor(sd, "state.0.0.step")->item() == 1);
  CHECK(find_tensor(sd, "state.0.1.step") == nullptr);
  // b's first update is a first step (bias corrections with t = 1).
  grad(b, {-3.0});
  opt.step();
  check_close(val(b), {1.0 + 0.1 * 3.0 / (3.0 + 1e-8)});
  CHECK(find_tensor(opt.state_dict(), "state.0.0.step")->item() == 2);
  CHECK(find_tensor(opt.state_dict(), "state.0.1.step")->item() == 1);
}

TEST_CASE("optimisers update module parameters after a backward pass") {
  // Fit y = 2x + 1 with one Linear layer and a squared error.
  Generator gen(3);
  Linear lin(1, 1, gen);
  lin.to(DType::f64);
  SGD opt(lin.parameters(), {.lr = 0.1, .momentum = 0.5});
  Tensor x = from_vector<double>({-1, -0.5, 0, 0.5, 1, 1.5}, {6, 1});
  Tensor y = x * 2.0 + 1.0;
  for (int s = 0; s < 200; ++s) {
    opt.zero_grad();
    Tensor loss = mean(square(lin(x) - y));
    loss.backward();
    opt.step();
  }
  CHECK(lin.weight().item() == doctest::Approx(2.0).epsilon(1e-6));
  CHECK(lin.bias().item() == doctest::Approx(1.0).epsilon(1e-6));
}

// ---- state dicts ----

TEST_CASE("optimizer state_dict names and round trip give an identical next step") {
  Tensor a = param({1.0, 2.0, 3.0}), b = param({-1.0});
  Adam opt(std::vector<ParamGroup>{{.params = {a}}, {.params = {b}, .lr = 0.02}},
           {.lr = 0.05, .weight_decay = 0.1, .amsgrad = true});
  for (int s = 0; s < 3; ++s) {
    grad(a, {0.1 * s, -0.2, 0.3 + s});
    grad(b, {0.5 - s});
    opt.step();
  }
  const StateDict sd = snapshot(opt.state_dict());
  CHECK(names(sd) ==
        std::vector<std::string>{"groups.0.lr", "groups.0.weight_decay", "groups.0.num_params",
                                 "groups.1.lr", "groups.1.weight_decay", "groups.1.num_params",
                                 "hparams.beta1", "hparams.beta2", "hparams.eps", "hparams.amsgrad",
                                 "state.0.0.step", "state.0.0.exp_avg", "state.0.0.exp_avg_sq",
                                 "state.0.0.max_exp_avg_sq", "state.1.0.step", "state.1.0.exp_avg",
                                 "state.1.0.exp_avg_sq", "state.1.0.max_exp_avg_sq"});
  CHECK(find_tensor(sd, "state.0.0.step")->dtype() == DType::i64);
  CHECK(find_tensor(sd, "state.0.0.step")->item() == 3);
  CHECK(find_tensor(sd, "groups.1.lr")->item() == 0.02);
  CHECK(find_tensor(sd, "hparams.amsgrad")->item() == 1.0);

  // A fresh optimizer with other settings, over copies of the parameters.
  Tensor a2 = a.detach().clone().requires_grad_(), b2 = b.detach().clone().requires_grad_();
  Adam opt2(std::vector<ParamGroup>{{.params = {a2}}, {.params = {b2}}}, {.lr = 1.0});
  opt2.load_state_dict(sd);
  CHECK(opt2.lr() == 0.05);
  CHECK(*opt2.param_groups()[1].lr == 0.02);
  CHECK(*opt2.param_groups()[0].weight_decay == 0.1);
  for (Tensor* t : {&a, &a2}) grad(*t, {0.7, 0.1, -0.4});
  for (Tensor* t : {&b, &b2}) grad(*t, {0.2});
  opt.step();
  opt2.step();
  CHECK(val(a2) == val(a));
  CHECK(val(b2) == val(b));

  // SGD with momentum: the buffer comes back too.
  Tensor s1 = param({1.0, 2.0});
  SGD sgd({s1}, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  grad(s1, {0.3, -0.1});
  sgd.step();
  const StateDict ssd = snapshot(sgd.state_dict());
  CHECK(names(ssd) == std::vector<std::string>{"groups.0.lr", "groups.0.weight_decay",
                                               "groups.0.num_params", "hparams.momentum",
                                               "hparams.dampening", "hparams.nesterov",
                                               "state.0.0.step", "state.0.0.momentum_buffer"});
  Tensor s2 = s1.detach().clone().requires_grad_();
  SGD sgd2({s2}, {.lr = 0.5});
  sgd2.load_state_dict(ssd);
  grad(s1, {0.2, 0.2});
  grad(s2, {0.2, 0.2});
  sgd.step();
  sgd2.step();
  CHECK(val(s2) == val(s1));
}

TEST_CASE("optimizer load_state_dict names every bad key and changes nothing") {
  Tensor a = param({1.0, 2.0});
  Adam adam({a});
  grad(a, {1.0, 1.0});
  adam.step();
  StateDict sd = snapshot(adam.state_dict());

  Tensor p = param({1.0, 2.0});
  SGD sgd({p}, {.lr = 0.3, .momentum = 0.9});
  const std::string msg = error_of([&] { sgd.load_state_dict(sd); });
  CAPTURE(msg);
  CHECK(contains(msg, "[SGD::load_state_dict]"));
  CHECK(contains(msg,
                 "missing keys: hparams.momentum, hparams.dampening, hparams.nesterov, "
                 "state.0.0.momentum_buffer"));
  CHECK(contains(msg,
                 "unexpected keys: hparams.beta1, hparams.beta2, hparams.eps, "
                 "hparams.amsgrad, state.0.0.exp_avg, state.0.0.exp_avg_sq"));
  CHECK(sgd.lr() == 0.3);

  StateDict bad;
  for (const auto& [k, v] : sd) {
    if (k == "state.0.0.exp_avg")
      bad.emplace_back(k, zeros({3}, {.dtype = DType::f64}));
    else if (k != "state.0.0.exp_avg_sq")
      bad.emplace_back(k, v);
  }
  bad.emplace_back("state.0.7.step", scalar(1, {.dtype = DType::i64}));
  Tensor q = param({1.0, 2.0});
  Adam adam2({q}, {.lr = 0.7});
  const std::string msg2 = error_of([&] { adam2.load_state_dict(bad); });
  CAPTURE(msg2);
  CHECK(contains(msg2, "missing keys: state.0.0.exp_avg_sq"));
  CHECK(contains(msg2, "unexpected keys: state.0.7.step"));
  CHECK(contains(msg2, "mismatched keys: state.0.0.exp_avg (expected [2] floating, got [3] f64)"));
  CHECK(adam2.lr() == 0.7);
  CHECK(adam2.state_dict().size() == 7);  // no per-parameter state was loaded
}

// ---- clipping ----

TEST_CASE("clip_grad_norm_ scales all gradients by one factor") {
  Tensor a = param({0.0, 0.0}), b = param({0.0}), c = param({0.0});
  grad(a, {3.0, 4.0});
  grad(b, {12.0});
  // c has no gradient and is ignored.
  const double total = clip_grad_norm_({a, b, c}, 6.5);
  CHECK(total == doctest::Approx(13.0));
  const double coef = 6.5 / (13.0 + 1e-6);
  check_close(val(a.grad()), {3.0 * coef, 4.0 * coef});
  check_close(val(b.grad()), {12.0 * coef});
  CHECK_FALSE(c.grad().defined());

  // Below the limit nothing changes.
  grad(a, {3.0, 4.0});
  grad(b, {12.0});
  CHECK(clip_grad_norm_({a, b}, 100.0) == doctest::Approx(13.0));
  CHECK(val(a.grad()) == std::vector<double>{3.0, 4.0});

  // The inf-norm is the largest |g|; the 1-norm the sum of |g|.
  grad(a, {3.0, -4.0});
  CHECK(clip_grad_norm_({a, b}, 1000.0, 1.0) == doctest::Approx(19.0));
  CHECK(clip_grad_norm_({a, b}, 2.0, INFINITY) == doctest::Approx(12.0));
  const double coef_inf = 2.0 / (12.0 + 1e-6);
  check_close(val(a.grad()), {3.0 * coef_inf, -4.0 * coef_inf});
  check_close(val(b.grad()), {12.0 * coef_inf});

  grad(b, {NAN});
  CHECK_THROWS_AS(clip_grad_norm_({a, b}, 1.0, 2.0, /*error_if_nonfinite=*/true),
                  std::runtime_error);
  CHECK(std::isnan(clip_grad_norm_({a, b}, 1.0)));
  CHECK(std::isnan(val(a.grad())[0]));  // the NaN factor reaches every gradient
  grad(a, {3.0, 4.0});
  grad(b, {NAN});
  CHECK(std::isnan(clip_grad_norm_({a, b}, 1.0, INFINITY)));  // NaN wins the inf-norm too
  CHECK_THROWS_AS(clip_grad_norm_({a}, 1.0, 0.0), std::invalid_argument);
  CHECK(clip_grad_norm_({}, 1.0) == 0.0);
}

TEST_CASE("clip_grad_norm_no_sync_ clips as clip_grad_norm_ does, its total left as a tensor") {
  for (const double norm_type : {2.0, 1.0, double(INFINITY)}) {
    CAPTURE(norm_type);
    Tensor a = param({0.0, 0.0}), b = param({0.0}), c = param({0.0}), d = param({0.0, 0.0});
    Tensor e = param({0.0}), f = param({0.0});
    grad(a, {3.0, -4.0});
    grad(b, {12.0});
    grad(d, {3.0, -4.0});
    grad(e, {12.0});
    const double total = clip_grad_norm_({a, b, c}, 2.0, norm_type);
    const Tensor lazy = clip_grad_norm_no_sync_({d, e, f}, 2.0, norm_type);
    CHECK(lazy.dim() == 0);
    CHECK(lazy.dtype() == DType::f64);
    CHECK(lazy.item() == total);
    CHECK(val(d.grad()) == val(a.grad()));  // the same factor, bit for bit
    CHECK(val(e.grad()) == val(b.grad()));
    CHECK_FALSE(f.grad().defined());
  }
  Tensor a = param({0.0});
  CHECK(clip_grad_norm_no_sync_({a}, 1.0).item() == 0.0);  // no gradients: a zero
  CHECK_THROWS_AS(clip_grad_norm_no_sync_({a}, -1.0), std::invalid_argument);
}

TEST_CASE("grad_norms: each gradient's norm(g) in f64, in order, on every device and dtype mix") {
  Generator gen(7);
  for (const Device dev : quanta::testing::cpu_and_test_devices()) {
    for (const double norm_type : {2.0, 1.0, 3.0, double(INFINITY)}) {
      INFO(dev.str() << " p=" << norm_type);
      // One dtype (the one-buffer path), then f32 beside f64 (one norm each),
      // an empty gradient skipped in both.
      const std::vector<Tensor> f32s = {randn({5, 3}, gen).to(dev), randn({0}, gen).to(dev),
                                        randn({7}, gen).to(dev), randn({2, 2, 2}, gen).to(dev)};
      std::vector<Tensor> mixed = f32s;
      mixed[2] = mixed[2].to(DType::f64);
      for (const auto& grads : {f32s, mixed}) {
        std::vector<Tensor> expected;
        for (const Tensor& g : grads)
          if (g.numel() > 0) expected.push_back(norm(g, norm_type).to(DType::f64).to(dev));
        const Tensor got = grad_norms(grads, norm_type);
        CHECK(got.dtype() == DType::f64);
        CHECK(got.device() == dev);
        CHECK(val(got.to(Device::cpu())) == val(stack(expected).to(Device::cpu())));  // bit for bit
      }
      // A strided gradient reads as its values.
      const Tensor t = transpose(randn({4, 6}, gen).to(dev), 0, 1);
      CHECK(val(grad_norms({t}, norm_type).to(Device::cpu())) ==
            val(norm(t, norm_type).to(DType::f64).reshape({1}).to(Device::cpu())));
    }
  }
  CHECK_THROWS_WITH_AS(grad_norms({from_vector<float>({1.0f})}, 0.0),
                       doctest::Contains("[norm] p must be > 0"), std::invalid_argument);
}

TEST_CASE("clipping a device's f32 gradients: a norm kernel and a scale each, no copies") {
  // A QLoRA step clips dozens of adapter gradients: per gradient, a norm
  // into one buffer and the scaling, the factor converted once.
  const Device dev = Device::sim(0);
  Generator gen(3);
  std::vector<Tensor> params;
  for (int i = 0; i < 12; ++i) {
    params.push_back(zeros({4, 3}, {.device = dev}).requires_grad_());
    params.back().set_grad(randn({4, 3}, gen).to(dev));
  }
  (void)clip_grad_norm_no_sync_(params, 0.5);  // made outside the graph: its constants
  Tensor total;
  const int64_t work = DeviceGraph::capture(dev, [&] {
                         total = clip_grad_norm_no_sync_(params, 0.5);
                       }).recorded_work();
  INFO("recorded " << work);
  CHECK(work < 3 * 12);  // 2 a gradient and 8 for the total and the factor; was 5 a gradient
}

TEST_CASE("clip_grad_value_ clamps each gradient") {
  Tensor a = param({0.0, 0.0, 0.0});
  grad(a, {-3.0, 0.5, 2.0});
  clip_grad_value_({a}, 1.0);
  CHECK(val(a.grad()) == std::vector<double>{-1.0, 0.5, 1.0});
  CHECK_THROWS_AS(clip_grad_value_({a}, -1.0), std::invalid_argument);
}

// ---- schedules ----

TEST_CASE("WarmupLinearDecay warms up, then falls linearly to min_lr at total_steps") {
  Tensor a = param({0.0});
  SGD opt({a}, {.lr = 1.0});
  WarmupLinearDecay sched(opt, 2, 6, 0.2);
  // Warmup (s + 1) / 2, then 0.2 + 0.8 (6 - s) / 4, then min_lr.
  const std::vector<double> want = {0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2};
  for (size_t s = 0; s < want.size(); ++s) {
    CAPTURE(s);
    CHECK(sched.lr_at(static_cast<int64_t>(s)) == doctest::Approx(want[s]).epsilon(1e-14));
    CHECK(opt.lr() == doctest::Approx(want[s]).epsilon(1e-14));
    sched.step();
  }
  SGD opt0({param({0.0})}, {.lr = 0.3});
  CHECK(WarmupLinearDecay(opt0, 0, 3).lr_at(0) == doctest::Approx(0.3));
  CHECK(WarmupLinearDecay(opt0, 0, 3).lr_at(2) == doctest::Approx(0.1));
  CHECK_THROWS_AS(WarmupLinearDecay(opt0, 5, 4), std::invalid_argument);
  CHECK_THROWS_AS(WarmupLinearDecay(opt0, 0, 4, -1.0), std::invalid_argument);
}

TEST_CASE("WarmupCosine warms up linearly, then follows a cosine to min_lr") {
  Tensor a = param({0.0}), b = param({0.0});
  SGD opt(std::vector<ParamGroup>{{.params = {a}}, {.params = {b}, .lr = 0.2}}, {.lr = 1.0});
  WarmupCosine sched(opt, 2, 6, 0.1);
  const double c = std::cos(std::numbers::pi / 4);
  const std::vector<double> want = {0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c),
                                    0.1, 0.1};
  CHECK(opt.lr() == 0.5);  // lr_at(0) is set at construction
  for (size_t s = 0; s < want.size(); ++s) {
    CAPTURE(s);
    CHECK(sched.lr_at(static_cast<int64_t>(s)) == doctest::Approx(want[s]).epsilon(1e-14));
    CHECK(opt.lr() == doctest::Approx(want[s]).epsilon(1e-14));
    CHECK(sched.current_step() == static_cast<int64_t>(s));
    sched.step();
  }
  CHECK(sched.lr_at(1000) == 0.1);
  // Each group from its own base lr, to the same min_lr.
  CHECK(sched.lr_at(0, 1) == doctest::Approx(0.1));
  CHECK(sched.lr_at(4, 1) == doctest::Approx(0.1 + 0.1 * 0.5));
  CHECK(sched.base_lrs() == std::vector<double>{1.0, 0.2});

  SGD opt0({param({0.0})}, {.lr = 0.3});
  WarmupCosine no_warmup(opt0, 0, 4);
  CHECK(no_warmup.lr_at(0) == doctest::Approx(0.3));
  CHECK(no_warmup.lr_at(2) == doctest::Approx(0.15));
  CHECK(no_warmup.lr_at(4) == 0.0);
  CHECK_THROWS_AS(WarmupCosine(opt0, 5, 4), std::invalid_argument);
}

TEST_CASE("LinearWarmup ramps up, then stays at the base lr") {
  SGD opt({param({0.0})}, {.lr = 2.0});
  LinearWarmup sched(opt, 4);
  const std::vector<double> want = {0.5, 1.0, 1.5, 2.0, 2.0, 2.0};
  for (size_t s = 0; s < want.size(); ++s) {
    CHECK(opt.lr() == doctest::Approx(want[s]));
    sched.step();
  }
  CHECK_THROWS_AS(LinearWarmup(opt, -1), std::invalid_argument);
}

TEST_CASE("schedule state_dict round trip restores the step and base lrs") {
  SGD opt({param({0.0})}, {.lr = 1.0});
  WarmupCosine sched(opt, 2, 10, 0.0);
  for (int s = 0; s < 5; ++s) sched.step();
  const StateDict sd = snapshot(sched.state_dict());
  CHECK(names(sd) == std::vector<std::string>{"step", "base_lrs.0"});

  SGD opt2({param({0.0})}, {.lr = 7.0});
  WarmupCosine sched2(opt2, 2, 10, 0.0);
  sched2.load_state_dict(sd);
  CHECK(sched2.current_step() == 5);
  CHECK(sched2.base_lrs() == std::vector<double>{1.0});
  CHECK(opt2.lr() == opt.lr());
  sched.step();
  sched2.step();
  CHECK(opt2.lr() == opt.lr());

  StateDict bad{{"base_lrs.0", scalar(1.0)}, {"extra", scalar(0.0)}};
  const std::string msg = error_of([&] { sched2.load_state_dict(bad); });
  CHECK(contains(msg, "missing keys: step"));
  CHECK(contains(msg, "unexpected keys: extra"));
  CHECK(sched2.current_step() == 6);
}

// ---- the device axis: the same steps on a GPU equal the CPU's ----

TEST_CASE("cuda: SGD, Adam (amsgrad) and AdamW steps and clipping equal the CPU's") {
  if (!quanta::testing::have_gpu()) MESSAGE("cuda:0 skipped: " << quanta::testing::no_gpu_reason());
  for (const Device gpu : quanta::testing::test_devices()) {
    INFO("on ", gpu.str());
    Generator gen(17);
    const Tensor p0 = randn({33, 7}, gen, {.dtype = DType::f64});
    std::vector<Tensor> grads;
    for (int s = 0; s < 4; ++s) grads.push_back(randn({33, 7}, gen, {.dtype = DType::f64}));
    auto run = [&](Device dev, int which) {
      // clone(): on the CPU to() returns p0 itself, which the steps would change.
      Tensor p = p0.to(dev).clone().detach().requires_grad_();
      std::unique_ptr<Optimizer> opt;
      if (which == 0)
        opt = std::make_unique<SGD>(
            std::vector<Tensor>{p},
            SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true, .weight_decay = 0.01});
      if (which == 1)
        opt = std::make_unique<Adam>(std::vector<Tensor>{p},
                                     AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true});
      if (which == 2)
        opt = std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamWOptions{.lr = 0.01});
      for (const Tensor& g : grads) {
        // A copy on both devices: clipping scales the gradient in place.
        p.set_grad(g.to(dev).clone());
        clip_grad_norm_({p}, 5.0);
        opt->step();
      }
      return p.detach().to(Device::cpu()).to_vector<double>();
    };
    for (int which = 0; which < 3; ++which) {
      CAPTURE(which);
      check_close(run(gpu, which), run(Device::cpu(), which), 1e-12);
    }
  }
}

TEST_CASE("cuda: the pieces of a step (norm, clipping, one unclipped SGD and AdamW step)") {
  if (!quanta::testing::have_gpu()) MESSAGE("cuda:0 skipped: " << quanta::testing::no_gpu_reason());
  for (const Device gpu : quanta::testing::test_devices()) {
    INFO("on ", gpu.str());
    Generator gen(23);
    const Tensor g = randn({33, 7}, gen, {.dtype = DType::f64});
    CHECK(norm(g.to(gpu), 2.0).item() == doctest::Approx(norm(g, 2.0).item()).epsilon(1e-12));
    CHECK(norm(g.to(gpu), 1.0).item() == doctest::Approx(norm(g, 1.0).item()).epsilon(1e-12));
    CHECK(sum(square(g.to(gpu))).item() == doctest::Approx(sum(square(g)).item()).epsilon(1e-12));
    for (Device dev : {Device::cpu(), gpu}) {
      Tensor p = g.to(dev).clone().detach().requires_grad_();
      p.set_grad(g.to(dev).clone());
      const double total = clip_grad_norm_({p}, 5.0);
      CAPTURE(dev.str());
      CHECK(total == doctest::Approx(norm(g, 2.0).item()).epsilon(1e-12));
      CHECK(norm(p.grad(), 2.0).item() == doctest::Approx(5.0).epsilon(1e-6));
    }
    auto one_step = [&](Device dev, bool adamw) {
      Tensor p = g.to(dev).clone().detach().requires_grad_();  // never g itself
      p.set_grad(square(g).to(dev));
      if (adamw) {
        AdamW opt({p}, AdamWOptions{.lr = 0.01});
        opt.step();
      } else {
        SGD opt({p}, SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
        opt.step();
      }
      return p.detach().to(Device::cpu()).to_vector<double>();
    };
    check_close(one_step(gpu, false), one_step(Device::cpu(), false), 1e-12);
    check_close(one_step(gpu, true), one_step(Device::cpu(), true), 1e-12);
  }
}

// ---- the fused steps (kernel table's sgd_step / adam_step) ----

namespace {

// Every optimiser setting whose arithmetic differs: SGD's weight decay,
// momentum with dampening, nesterov; Adam's coupled decay, both lerp
// formulas (1 - beta1 below and above 0.5), amsgrad; AdamW's decoupled decay.
std::unique_ptr<Optimizer> make_opt(int which, const Tensor& p) {
  const std::vector<Tensor> ps{p};
  switch (which) {
    case 0:
      return std::make_unique<SGD>(ps, SGDOptions{.lr = 0.1});
    case 1:
      return std::make_unique<SGD>(ps, SGDOptions{.lr = 0.07, .weight_decay = 0.03});
    case 2:
      return std::make_unique<SGD>(ps, SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.2});
    case 3:
      return std::make_unique<SGD>(
          ps, SGDOptions{.lr = 0.1, .momentum = 0.8, .nesterov = true, .weight_decay = 0.01});
    case 4:
      return std::make_unique<Adam>(ps, AdamOptions{.lr = 0.01});
    case 5:
      return std::make_unique<Adam>(ps, AdamOptions{.lr = 0.02, .weight_decay = 0.1});
    case 6:
      return std::make_unique<Adam>(ps,
                                    AdamOptions{.lr = 0.01, .betas = {0.3, 0.99}, .amsgrad = true});
    default:
      return std::make_unique<AdamW>(ps, AdamWOptions{.lr = 0.01, .weight_decay = 0.05});
  }
}
constexpr int kOptSettings = 8;

// Four steps of setting `which` from p0 with `grads`, on a parameter that is
// contiguous (the fused step) or a transposed view (the op chain); returns
// the parameter and its buffers, contiguous, on the CPU.
std::vector<Tensor> four_steps(int which, const Tensor& p0, const std::vector<Tensor>& grads,
                               Device dev, bool contiguous) {
  Tensor p = contiguous ? p0.to(dev).clone()
                        : p0.t().contiguous().to(dev).t();  // same values, transposed strides
  p = p.detach().requires_grad_();
  CHECK(p.is_contiguous() == contiguous);
  auto opt = make_opt(which, p);
  for (const Tensor& g : grads) {
    p.set_grad(g.to(dev).clone());
    opt->step();
  }
  std::vector<Tensor> out{p.detach().to(Device::cpu()).contiguous()};
  for (const auto& [k, v] : opt->state_dict())
    if (v.dim() > 0) out.push_back(v.to(Device::cpu()).contiguous());
  return out;
}

void check_same_bits(const std::vector<Tensor>& got, const std::vector<Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    CAPTURE(k);
    REQUIRE(got[k].dtype() == want[k].dtype());
    const auto a = got[k].to_vector<double>(), b = want[k].to_vector<double>();
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    CHECK(differ == 0);
  }
}

}  // namespace

TEST_CASE("fused SGD, Adam and AdamW steps equal the op chain bit for bit (f32, f64)") {
  // A small parameter, and one the kernels split into parallel chunks.
  for (const Shape& shape : {Shape{7, 33}, Shape{300, 257}})
    for (DType t : {DType::f32, DType::f64}) {
      Generator gen(31);
      const Tensor p0 = randn(shape, gen, {.dtype = t});
      std::vector<Tensor> grads;
      for (int s = 0; s < 4; ++s) grads.push_back(randn(shape, gen, {.dtype = t}));
      for (int which = 0; which < kOptSettings; ++which) {
        CAPTURE(shape_str(shape));
        CAPTURE(dtype_name(t));
        CAPTURE(which);
        check_same_bits(four_steps(which, p0, grads, Device::cpu(), true),
                        four_steps(which, p0, grads, Device::cpu(), false));
      }
    }
}

TEST_CASE("fused steps: 16-bit and zero-size parameters, buffers made on the first step") {
  Generator gen(5);
  for (int which = 0; which < kOptSettings; ++which) {
    CAPTURE(which);
    // bf16 runs the chain (computing in f32); the result keeps its dtype.
    Tensor p = randn({4, 3}, gen, {.dtype = DType::bf16}).requires_grad_();
    auto opt = make_opt(which, p);
    p.set_grad(ones({4, 3}, {.dtype = DType::bf16}));
    opt->step();
    CHECK(p.dtype() == DType::bf16);
    Tensor z = zeros({0, 3}).requires_grad_();
    auto oz = make_opt(which, z);
    z.set_grad(zeros({0, 3}));
    oz->step();
    for (const auto& [k, v] : oz->state_dict())
      if (v.dim() > 0) CHECK(v.shape() == Shape{0, 3});
  }
  // The first momentum step stores the direction itself (the chain's clone).
  Tensor p = from_vector(std::vector<double>{1.0, -2.0}).requires_grad_();
  SGD opt({p}, SGDOptions{.lr = 0.5, .momentum = 0.9, .weight_decay = 0.25});
  grad(p, {0.5, 0.5});
  opt.step();
  check_close(val(*find_tensor(opt.state_dict(), "state.0.0.momentum_buffer")),
              {0.5 + 0.25 * 1.0, 0.5 + 0.25 * -2.0});
}

TEST_CASE("Adam over many parameters: one batched step equals each parameter stepped alone") {
  // 20 parameters (more than the 16 of one CUDA launch; one empty, one
  // transposed and so stepped by the chain), in two groups with their own
  // lr, and one parameter without a gradient in the middle steps: its step
  // count, and with it its bias corrections, falls behind the others'.
  std::vector<Device> devices{Device::cpu()};
  for (const Device d : quanta::testing::test_devices()) devices.push_back(d);
  for (const Device dev : devices) {
    for (DType t : {DType::f32, DType::f64}) {
      CAPTURE(dev.str());
      CAPTURE(dtype_name(t));
      Generator gen(77);
      std::vector<Tensor> start;
      for (int i = 0; i < 20; ++i) {
        const Shape shape = i == 3 ? Shape{0, 4} : Shape{1 + i % 5, 3 + 7 * i};
        start.push_back(randn(shape, gen, {.dtype = t}));
      }
      std::vector<std::vector<Tensor>> grads(3);
      for (auto& step : grads)
        for (const Tensor& p : start) step.push_back(randn(p.shape(), gen, {.dtype = t}));
      const auto param = [&](int i) {
        Tensor p = i == 5 ? start[i].t().contiguous().to(dev).t() : start[i].to(dev).clone();
        return p.detach().requires_grad_();
      };
      const AdamOptions opts{.lr = 0.01, .weight_decay = 0.02, .amsgrad = true};
      const auto run = [&](const std::vector<int>& which) {
        std::vector<Tensor> ps;
        for (int i : which) ps.push_back(param(i));
        std::vector<ParamGroup> groups(2);
        for (size_t k = 0; k < ps.size(); ++k) groups[which[k] % 2].params.push_back(ps[k]);
        groups[1].lr = 0.03;
        std::erase_if(groups, [](const auto& g) { return g.params.empty(); });
        Adam opt(groups, opts);
        for (size_t s = 0; s < grads.size(); ++s) {
          for (size_t k = 0; k < ps.size(); ++k)
            if (which[k] == 7 && s == 1)
              ps[k].set_grad(Tensor());
            else
              ps[k].set_grad(grads[s][which[k]].to(dev).clone());
          opt.step();
        }
        std::vector<Tensor> out;
        for (const Tensor& p : ps) out.push_back(p.detach().to(Device::cpu()).contiguous());
        return out;
      };
      std::vector<int> all(20);
      for (int i = 0; i < 20; ++i) all[i] = i;
      const std::vector<Tensor> together = run(all);
      for (int i = 0; i < 20; ++i) {
        CAPTURE(i);
        check_same_bits({together[i]}, run({i}));
      }
    }
  }
}

TEST_CASE("cuda: fused steps equal the device's op chain bit for bit, and the CPU's") {
  if (!quanta::testing::have_gpu()) MESSAGE("cuda:0 skipped: " << quanta::testing::no_gpu_reason());
  for (const Device gpu : quanta::testing::test_devices()) {
    INFO("on ", gpu.str());
    for (DType t : {DType::f32, DType::f64}) {
      Generator gen(41);
      const Tensor p0 = randn({129, 65}, gen, {.dtype = t});
      std::vector<Tensor> grads;
      for (int s = 0; s < 4; ++s) grads.push_back(randn({129, 65}, gen, {.dtype = t}));
      for (int which = 0; which < kOptSettings; ++which) {
        CAPTURE(dtype_name(t));
        CAPTURE(which);
        const auto fused = four_steps(which, p0, grads, gpu, true);
        check_same_bits(fused, four_steps(which, p0, grads, gpu, false));
        // The CPU's sqrt kernel (Eigen's fast vector form) differs in the last
        // bits, so Adam's steps agree with the CPU's to rounding, SGD's exactly.
        const auto cpu = four_steps(which, p0, grads, Device::cpu(), true);
        if (which < 4) check_same_bits(fused, cpu);
        for (size_t k = 0; k < fused.size(); ++k)
          check_close(fused[k].to_vector<double>(), cpu[k].to_vector<double>(),
                      t == DType::f32 ? 1e-5 : 1e-12);
      }
    }
  }
}
