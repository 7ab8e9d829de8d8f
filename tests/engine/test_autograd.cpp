// The reverse-mode engine: ordering, accumulation, guards, custom functions, hooks.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <thread>

#include "quanta.h"

using namespace quanta;

TEST_CASE("diamond graphs accumulate every path") {
  Tensor x = from_vector<double>({2.0}).requires_grad_();
  Tensor a = x * 3.0, b = x * x;
  Tensor y = a * b + a;  // 3x^3 + 3x -> 9x^2 + 3
  y.backward();
  CHECK(x.grad().item() == doctest::Approx(39.0));
  // A second backward accumulates into .grad.
  Tensor z = x * 2.0;
  z.backward();
  CHECK(x.grad().item() == doctest::Approx(41.0));
  x.zero_grad();
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("a leaf used many times gets one accumulator and its hook runs once") {
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  int calls = 0;
  Tensor seen;
  x.register_post_accumulate_hook([&](const Tensor& leaf) {
    ++calls;
    seen = leaf.grad();
  });
  Tensor y = sum(x * x + x * 4.0 + exp(x));
  y.backward();
  CHECK(calls == 1);
  CHECK(seen.to_vector<double>()[1] == doctest::Approx(2 * 2.0 + 4 + std::exp(2.0)));
}

TEST_CASE("non-scalar outputs need an explicit gradient") {
  Tensor x = from_vector<double>({1.0, 2.0, 3.0}).requires_grad_();
  Tensor y = x * 2.0;
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("one-element output"),
                       std::invalid_argument);
  y.backward(from_vector<double>({1.0, 10.0, 100.0}));
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 20, 200});
  CHECK_THROWS_WITH_AS(y.backward(from_vector<double>({1.0})), doctest::Contains("does not match"),
                       std::invalid_argument);
}

TEST_CASE("retain_graph: a freed graph fails clearly, a retained one runs twice") {
  Tensor x = from_vector<double>({3.0}).requires_grad_();
  Tensor y = exp(x);
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  CHECK(x.grad().item() == doctest::Approx(2 * std::exp(3.0)));
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("already freed"), std::runtime_error);
}

TEST_CASE("NoGradGuard and InferenceGuard record nothing; EnableGradGuard re-enables") {
  Tensor x = from_vector<double>({1.0}).requires_grad_();
  {
    NoGradGuard ng;
    CHECK_FALSE(grad_enabled());
    Tensor y = x * 2.0;
    CHECK_FALSE(y.requires_grad());
    {
      EnableGradGuard eg;
      CHECK((x * 2.0).requires_grad());
    }
    CHECK_FALSE(inference_mode());
  }
  {
    InferenceGuard ig;
    CHECK(inference_mode());
    CHECK_FALSE((x * 2.0).requires_grad());
  }
  CHECK(grad_enabled());
  CHECK_FALSE(inference_mode());
  CHECK_THROWS_WITH_AS((x.detach() * 2.0).backward(), doctest::Contains("does not require grad"),
                       std::invalid_argument);
}

TEST_CASE("guards are per thread") {
  NoGradGuard ng;
  bool other = false;
  std::thread t([&] { other = grad_enabled(); });
  t.join();
  CHECK(other);
  CHECK_FALSE(grad_enabled());
}

TEST_CASE("custom functions: straight-through sign with a clipped gradient") {
  autograd::Function ste{
      "ste_sign", [](const std::vector<Tensor>& in) { return std::vector<Tensor>{sign(in[0])}; },
      nullptr};
  Tensor saved;
  ste.forward = [&saved](const std::vector<Tensor>& in) {
    saved = in[0].detach();
    return std::vector<Tensor>{sign(in[0])};
  };
  ste.backward = [&saved](const std::vector<Tensor>& g) {
    Tensor inside = le(abs(saved), scalar(1.0, {.dtype = DType::f64}));
    return std::vector<Tensor>{where(inside, g[0], zeros_like(g[0]))};
  };
  Tensor x = from_vector<double>({-2.0, -0.5, 0.5, 3.0}).requires_grad_();
  auto out = autograd::apply(ste, {x});
  CHECK(out[0].to_vector<double>() == std::vector<double>{-1, -1, 1, 1});
  CHECK(out[0].grad_fn()->name() == "ste_sign");
  sum(out[0] * 2.0).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 2, 2, 0});
}

TEST_CASE("custom functions with several outputs get zeros for unused ones") {
  autograd::Function split2{
      "split2",
      [](const std::vector<Tensor>& in) {
        return std::vector<Tensor>{in[0] * 2.0, in[0] * 3.0};
      },
      [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0] * 2.0 + g[1] * 3.0}; }};
  Tensor x = from_vector<double>({1.0, 1.0}).requires_grad_();
  auto out = autograd::apply(split2, {x});
  sum(out[1]).backward();  // out[0] unused: its gradient arrives as zeros
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 3});
}

TEST_CASE("autograd::grad returns gradients without touching .grad") {
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  Tensor w = from_vector<double>({5.0}).requires_grad_();
  Tensor y = sum(x * x) * w;
  auto g = autograd::grad({y}, {x, w});
  CHECK(g[0].to_vector<double>() == std::vector<double>{10, 20});
  CHECK(g[1].item() == doctest::Approx(5.0));
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("a backward formula returning a wrong shape is caught") {
  autograd::Function bad{
      "bad", [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] * 1.0}; },
      [](const std::vector<Tensor>&) {
        return std::vector<Tensor>{zeros({5}, {.dtype = DType::f64})};
      }};
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  auto out = autograd::apply(bad, {x});
  CHECK_THROWS_WITH_AS(sum(out[0]).backward(),
                       doctest::Contains("bad returned a gradient of shape [5]"),
                       std::runtime_error);
}

TEST_CASE("requires_grad_ rules") {
  CHECK_THROWS_WITH_AS(from_vector<int64_t>({1}).requires_grad_(),
                       doctest::Contains("only floating tensors"), std::invalid_argument);
  Tensor x = from_vector<double>({1.0}).requires_grad_();
  Tensor y = x * 2.0;
  CHECK_FALSE(y.is_leaf());
  CHECK_THROWS_AS(y.requires_grad_(false), std::invalid_argument);
  CHECK(ones({2}, {.requires_grad = true}).requires_grad());
}

TEST_CASE("deep chains do not overflow the stack") {
  Tensor x = from_vector<double>({1.0}).requires_grad_();
  Tensor y = x;
  for (int i = 0; i < 20000; ++i) y = y * 1.0;
  y.backward();
  CHECK(x.grad().item() == 1.0);
}

TEST_CASE("an op recorded without a gradient rule fails naming it, only when reached") {
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  Tensor y = autograd::record("no_rule_op", (x * 2.0).detach(), {x}, nullptr);
  CHECK(y.requires_grad());
  CHECK(y.grad_fn()->name() == "no_rule_op");
  // Backward through a path that avoids the op runs.
  sum(x * 3.0).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 3});
  // Reaching it throws its name, not std::bad_function_call.
  CHECK_THROWS_WITH_AS(sum(y).backward(), "[no_rule_op] has no gradient rule", std::runtime_error);
  CHECK_THROWS_WITH_AS(autograd::grad({sum(y * y)}, {x}), "[no_rule_op] has no gradient rule",
                       std::runtime_error);
  // The multi-output form behaves the same.
  auto outs =
      autograd::record("no_rule_pair", {(x + 1.0).detach(), (x - 1.0).detach()}, {x}, BackwardFn{});
  CHECK_THROWS_WITH_AS(sum(outs[1]).backward(), "[no_rule_pair] has no gradient rule",
                       std::runtime_error);
  // Without grad mode nothing is recorded, so there is nothing to fail.
  NoGradGuard no_grad;
  CHECK_FALSE(autograd::record("no_rule_op", (x * 2.0).detach(), {x}, nullptr).requires_grad());
}

TEST_CASE("custom functions without a backward fail naming the function") {
  autograd::Function fwd_only{
      "forward_only",
      [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] * 2.0}; }, nullptr};
  Tensor x = from_vector<double>({1.0});
  CHECK(autograd::apply(fwd_only, {x})[0].item() == 2.0);  // no grad needed: fine
  x.requires_grad_();
  CHECK_THROWS_WITH_AS(autograd::apply(fwd_only, {x}), doctest::Contains("[forward_only]"),
                       std::invalid_argument);
}

TEST_CASE("a backward returning the wrong number of gradients fails naming the op") {
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  Tensor w = from_vector<double>({3.0}).requires_grad_();
  autograd::Function extra{
      "two_for_one", [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] * 1.0}; },
      [](const std::vector<Tensor>& g) {
        return std::vector<Tensor>{g[0], g[0]};
      }};
  CHECK_THROWS_WITH_AS(sum(autograd::apply(extra, {x})[0]).backward(),
                       "[two_for_one] backward returned 2 gradients, expected 1",
                       std::runtime_error);
  Tensor y = autograd::record("one_for_two", (x * w).detach(), {x, w},
                              [](const Tensor& g) { return std::vector<Tensor>{g}; });
  CHECK_THROWS_WITH_AS(sum(y).backward(), "[one_for_two] backward returned 1 gradients, expected 2",
                       std::runtime_error);
  Tensor z = autograd::record("none_for_one", (x * 1.0).detach(), {x},
                              [](const Tensor&) { return std::vector<Tensor>{}; });
  CHECK_THROWS_WITH_AS(sum(z).backward(),
                       "[none_for_one] backward returned 0 gradients, expected 1",
                       std::runtime_error);
}

TEST_CASE("an undefined gradient for an input means zero, not a missing rule") {
  // A straight-through pair: x gets the gradient, q (which requires grad)
  // is deliberately sent nothing, like commitment_loss's stop-gradient.
  autograd::Function stop_q{
      "stop_q", [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] + in[1]}; },
      [](const std::vector<Tensor>& g) {
        return std::vector<Tensor>{g[0], Tensor()};
      }};
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  Tensor q = from_vector<double>({5.0, 6.0}).requires_grad_();
  sum(autograd::apply(stop_q, {x, q})[0] * 2.0).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 2});
  // q was reached, so its .grad exists, holding the zero it was sent.
  CHECK(q.grad().to_vector<double>() == std::vector<double>{0, 0});
  // Another path to q still accumulates; the undefined one adds nothing.
  Tensor out = autograd::apply(stop_q, {x, q})[0] + q * 3.0;
  auto g = autograd::grad({sum(out)}, {x, q});
  CHECK(g[0].to_vector<double>() == std::vector<double>{1, 1});
  CHECK(g[1].to_vector<double>() == std::vector<double>{3, 3});
}

TEST_CASE("in-place accumulation never writes into a gradient someone else holds") {
  // A backward that hands the same tensor to two inputs, and keeps it: the
  // engine sums into fresh buffers, not into the shared one.
  Tensor kept;
  autograd::Function fork{
      "fork", [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] + in[1]}; },
      [&kept](const std::vector<Tensor>& g) {
        kept = g[0];
        return std::vector<Tensor>{g[0], g[0]};
      }};
  Tensor x = from_vector<double>({1.0, 2.0}).requires_grad_();
  Tensor a = x * 1.0, b = x * 1.0;
  const Tensor seed = from_vector<double>({1.0, 10.0});
  Tensor y = autograd::apply(fork, {a, b})[0] + x * 3.0;
  y.backward(seed);
  CHECK(x.grad().to_vector<double>() == std::vector<double>{5, 50});
  CHECK(seed.to_vector<double>() == std::vector<double>{1, 10});  // the caller's seed
  CHECK(kept.to_vector<double>() == std::vector<double>{1, 10});  // the kept gradient
  // A leaf's adopted gradient is its own: changing it leaves the seed alone.
  Tensor z = from_vector<double>({1.0, 1.0}).requires_grad_();
  const Tensor seed2 = from_vector<double>({4.0, 5.0});
  (z * 1.0).backward(seed2);
  add_(z.grad(), seed2);
  CHECK(seed2.to_vector<double>() == std::vector<double>{4, 5});
  CHECK(z.grad().to_vector<double>() == std::vector<double>{8, 10});
}

TEST_CASE("binary ops keep for the backward only the inputs whose values it reads") {
  // add, sub and where read no input values (only shapes and dtypes), mul
  // reads each input for the other's gradient, div reads the divisor: an
  // input nobody else holds is freed once the forward returns.
  auto freed_after = [](const std::function<Tensor(const Tensor&, const Tensor&)>& op, bool a_grad,
                        bool b_grad) {
    // Intermediates (a leaf is held by its gradient accumulator anyway).
    Generator gen(1);
    const Tensor leaf_a = randn({8, 3}, gen).requires_grad_(a_grad);
    const Tensor leaf_b = (randn({3}, gen) + 3.0).requires_grad_(b_grad);
    Tensor a = leaf_a * 1.0, b = leaf_b * 1.0;
    std::weak_ptr<Storage> wa = a.storage(), wb = b.storage();
    Tensor y = op(a, b);
    a = Tensor();
    b = Tensor();
    return std::pair<bool, bool>{wa.expired(), wb.expired()};
  };
  using P = std::pair<bool, bool>;
  const auto add_op = [](const Tensor& a, const Tensor& b) { return add(a, b); };
  const auto sub_op = [](const Tensor& a, const Tensor& b) { return sub(a, b); };
  const auto mul_op = [](const Tensor& a, const Tensor& b) { return mul(a, b); };
  const auto div_op = [](const Tensor& a, const Tensor& b) { return div(a, b); };
  const auto where_op = [](const Tensor& a, const Tensor& b) {
    return where(gt(a, zeros_like(a)), a, b);
  };
  CHECK(freed_after(add_op, true, true) == P{true, true});
  CHECK(freed_after(sub_op, true, true) == P{true, true});
  CHECK(freed_after(where_op, true, true) == P{true, true});
  CHECK(freed_after(mul_op, true, false) == P{true, false});  // dy/da = b
  CHECK(freed_after(mul_op, false, true) == P{false, true});  // dy/db = a
  CHECK(freed_after(mul_op, true, true) == P{false, false});
  CHECK(freed_after(div_op, true, false) == P{true, false});
  // The gradients are the same as ever: broadcast summed away, dtype kept.
  Tensor a = ones({8, 3}).requires_grad_();
  Tensor b = full({3}, 2.0, {.dtype = DType::f64}).requires_grad_();
  sum(sub(mul(a, b), div(a, b))).backward();
  CHECK(b.grad().dtype() == DType::f64);
  CHECK(b.grad().shape() == Shape{3});
  CHECK(b.grad().to_vector<double>()[0] == doctest::Approx(8 * (1 + 1.0 / 4)));
  CHECK(a.grad().to_vector<float>()[0] == doctest::Approx(2 - 0.5));
}

namespace {

// y = 2 x whose backward adds 2 g onto the sum of x's other gradients when
// the engine offers it (gradient_sink), counting the offers.
Tensor twice(const Tensor& x, int& offered) {
  return autograd::record("twice", x.detach() * 2.0, {x},
                          [&offered, shape = x.shape(), dt = x.dtype()](const Tensor& g) {
                            Tensor sum = autograd::gradient_sink(0, shape, dt, g.device());
                            if (!sum.defined()) return std::vector<Tensor>{g * 2.0};
                            ++offered;
                            add_(sum, g, 2.0);
                            return std::vector<Tensor>{sum};
                          });
}

}  // namespace

TEST_CASE("gradient_sink: a formula adds onto the sum of its input's other gradients") {
  const Tensor seed = from_vector<double>({1.0, 10.0});
  SUBCASE("every consumer after the first adds in place, the sum is exact") {
    Tensor leaf = from_vector<double>({1.0, 2.0}).requires_grad_();
    Tensor x = leaf * 1.0;
    int offered = 0;
    // Later nodes run first: x * 5 gives the fresh sum, the three others
    // are each offered it (statements: the order of operands is unspecified).
    Tensor y = twice(x, offered);
    y = y + twice(x, offered);
    y = y + twice(x, offered);
    y = y + x * 5.0;
    y.backward(seed);
    CHECK(offered == 3);
    CHECK(leaf.grad().to_vector<double>() == std::vector<double>{11, 110});
  }
  SUBCASE("a sum someone else holds is not offered") {
    Tensor kept;
    autograd::Function keep{
        "keep", [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] * 1.0}; },
        [&kept](const std::vector<Tensor>& g) {
          kept = g[0];
          return std::vector<Tensor>{g[0]};
        }};
    Tensor leaf = from_vector<double>({1.0, 2.0}).requires_grad_();
    Tensor x = leaf * 1.0;
    int offered = 0;
    Tensor y = twice(x, offered);
    y = y + autograd::apply(keep, {x})[0];
    y.backward(seed);
    CHECK(offered == 0);
    CHECK(kept.to_vector<double>() == std::vector<double>{1, 10});
    CHECK(leaf.grad().to_vector<double>() == std::vector<double>{3, 30});
  }
  SUBCASE("one input reaching a node twice is offered the sum once") {
    Tensor leaf = from_vector<double>({1.0, 2.0}).requires_grad_();
    Tensor x = leaf * 1.0;
    int offered = 0;
    // y = 2 x + 2 x + 3 x through one node with x as both inputs.
    const auto both = [&offered](const Tensor& a, const Tensor& b) {
      return autograd::record("both", a.detach() * 2.0 + b.detach() * 2.0, {a, b},
                              [&offered, shape = a.shape(), dt = a.dtype()](const Tensor& g) {
                                std::vector<Tensor> out;
                                for (size_t i = 0; i < 2; ++i) {
                                  Tensor sum = autograd::gradient_sink(i, shape, dt, g.device());
                                  if (sum.defined()) {
                                    ++offered;
                                    add_(sum, g, 2.0);
                                    out.push_back(sum);
                                  } else {
                                    out.push_back(g * 2.0);
                                  }
                                }
                                return out;
                              });
    };
    Tensor y = both(x, x);
    y = y + x * 3.0;
    y.backward(seed);
    CHECK(offered == 1);
    CHECK(leaf.grad().to_vector<double>() == std::vector<double>{7, 70});
  }
  SUBCASE("a formula returning one gradient for two inputs reaching one sum adds it twice") {
    // add's backward hands g to both inputs: the same tensor, never an
    // offered sum, so the engine adds it for each.
    Tensor leaf = from_vector<double>({1.0, 2.0}).requires_grad_();
    Tensor x = leaf * 1.0;
    Tensor y = x * 3.0;
    y = y + add(x, x);
    y.backward(seed);
    CHECK(leaf.grad().to_vector<double>() == std::vector<double>{5, 50});
  }
  SUBCASE("a sum of another shape or dtype, or no backward running, gives nothing") {
    CHECK_FALSE(autograd::gradient_sink(0, {2}, DType::f64, Device::cpu()).defined());
    Tensor leaf = from_vector<double>({1.0, 2.0}).requires_grad_();
    Tensor x = leaf * 1.0;
    bool any = false;
    Tensor probe = autograd::record("probe", x.detach() * 1.0, {x}, [&any](const Tensor& g) {
      any = autograd::gradient_sink(0, {3}, DType::f64, g.device()).defined() ||
            autograd::gradient_sink(0, {2}, DType::f32, g.device()).defined() ||
            autograd::gradient_sink(1, {2}, DType::f64, g.device()).defined();
      return std::vector<Tensor>{g};
    });
    (probe + x * 2.0).backward(seed);  // either order: nothing matches
    CHECK_FALSE(any);
    CHECK(leaf.grad().to_vector<double>() == std::vector<double>{3, 30});
  }
}
