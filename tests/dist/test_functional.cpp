// Differentiable collectives: on N ranks, the gradient of sum_r L_r with
// respect to each rank's input equals the gradient of the same total loss
// computed on one process over all ranks' data (f64, tight tolerance).
#include <doctest/doctest.h>

#include <cmath>

#include "dist/functional.h"
#include "dist/random.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

constexpr int kRanks = 3;
const TensorOptions f64{.dtype = DType::f64};

// Deterministic, rank-dependent data and loss weights.
Tensor data(int r, const Shape& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return sin(arange(0.0, double(n), 1.0, f64) * 0.71 + 0.5 * r).reshape(shape);
}
Tensor leaf(int r, const Shape& shape) {
  Tensor x = data(r, shape).clone();
  x.requires_grad_();
  return x;
}
Tensor weights(int r, const Shape& shape) { return cos(data(r + 7, shape) * 1.3); }
// A nonlinear per-rank loss of a collective's output.
Tensor loss_of(int r, const Tensor& y) { return sum(weights(r, y.shape()) * y * y); }

void check_close(const Tensor& got, const Tensor& want) {
  REQUIRE(got.defined());
  REQUIRE(got.shape() == want.shape());
  const auto a = got.to_vector<double>(), b = want.to_vector<double>();
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-12));
}

// Runs `local(g, x_r) -> y_r` on every rank, backward through sum_r loss(y_r),
// and compares x_r.grad with the single-process gradient of
// sum_r loss(global(all x, r)).
void check_gradient(const std::function<Shape(int)>& shape_of,
                    const std::function<Tensor(ProcessGroup&, const Tensor&)>& local,
                    const std::function<Tensor(const std::vector<Tensor>&, int)>& global) {
  std::vector<Tensor> grads(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    Tensor x = leaf(g.rank(), shape_of(g.rank()));
    loss_of(g.rank(), local(g, x)).backward();
    grads[g.rank()] = x.grad().defined() ? x.grad() : zeros_like(x);
  });
  REQUIRE(all_ok(errors));
  std::vector<Tensor> xs;
  for (int r = 0; r < kRanks; ++r) xs.push_back(leaf(r, shape_of(r)));
  Tensor total = scalar(0.0, f64);
  for (int r = 0; r < kRanks; ++r) total = total + loss_of(r, global(xs, r));
  total.backward();
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(r);
    check_close(grads[r], xs[r].grad().defined() ? xs[r].grad() : zeros_like(xs[r]));
  }
}

Tensor sum_all(const std::vector<Tensor>& xs) {
  Tensor s = xs[0];
  for (std::size_t i = 1; i < xs.size(); ++i) s = s + xs[i];
  return s;
}

}  // namespace

TEST_CASE("fn::all_reduce sum and avg: gradient of the summed losses") {
  auto shape = [](int) { return Shape{2, 3}; };
  check_gradient(
      shape, [](ProcessGroup& g, const Tensor& x) { return fn::all_reduce(g, x); },
      [](const std::vector<Tensor>& xs, int) { return sum_all(xs); });
  check_gradient(
      shape, [](ProcessGroup& g, const Tensor& x) { return fn::all_reduce(g, x, ReduceOp::avg); },
      [](const std::vector<Tensor>& xs, int) { return sum_all(xs) / double(kRanks); });
  auto g = ProcessGroup::single();
  CHECK_THROWS_WITH_AS(fn::all_reduce(*g, zeros({2}), ReduceOp::max),
                       doctest::Contains("only sum and avg"), std::invalid_argument);
}

TEST_CASE("fn::all_gather <-> reduce_scatter") {
  check_gradient(
      [](int) {
        return Shape{2, 3};
      },
      [](ProcessGroup& g, const Tensor& x) { return fn::all_gather(g, x); },
      [](const std::vector<Tensor>& xs, int) { return cat(xs); });
}

TEST_CASE("fn::all_gather_v with uneven and empty parts <-> slice and reduce") {
  check_gradient(
      [](int r) {
        return Shape{r == 0 ? 0 : r + 1, 2};
      },
      [](ProcessGroup& g, const Tensor& x) { return fn::all_gather_v(g, x); },
      [](const std::vector<Tensor>& xs, int) { return cat(xs); });
}

TEST_CASE("fn::reduce_scatter <-> all_gather, sum and avg") {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
    check_gradient(
        [](int) {
          return Shape{kRanks * 2, 2};
        },
        [op](ProcessGroup& g, const Tensor& x) { return fn::reduce_scatter(g, x, op); },
        [op](const std::vector<Tensor>& xs, int r) {
          Tensor s = sum_all(xs);
          if (op == ReduceOp::avg) s = s / double(kRanks);
          return s.narrow(0, 2 * r, 2);
        });
  }
}

TEST_CASE("fn::broadcast <-> reduce to the root") {
  check_gradient([](int) { return Shape{3}; },
                 [](ProcessGroup& g, const Tensor& x) { return fn::broadcast(g, x, 1); },
                 [](const std::vector<Tensor>& xs, int) { return xs[1] * 1.0; });
}

TEST_CASE("fn::global_mean: token-weighted mean across uneven ranks, with its gradient") {
  // rank r holds r tokens (rank 0 none) of dimension 2; the loss uses the
  // mean over all tokens of all ranks.
  check_gradient(
      [](int r) {
        return Shape{r, 2};
      },
      [](ProcessGroup& g, const Tensor& x) {
        return fn::global_mean(g, sum(x, {0}), scalar(double(x.size(0))));
      },
      [](const std::vector<Tensor>& xs, int) {
        Tensor all = cat(xs);
        return sum(all, {0}) / double(all.size(0));
      });
  // No tokens anywhere: zeros, not NaN.
  auto errors = run_ranks(2, [](ProcessGroup& g) {
    Tensor m = fn::global_mean(g, zeros({2}), scalar(0.0));
    CHECK(m.to_vector<float>() == std::vector<float>{0, 0});
  });
  CHECK(all_ok(errors));
}

TEST_CASE("fn::global_mean with a host count: the tensor count's result, one division alone") {
  // Several ranks (rank r holds r tokens): the tensor path's values and gradient.
  check_gradient(
      [](int r) {
        return Shape{r, 2};
      },
      [](ProcessGroup& g, const Tensor& x) { return fn::global_mean(g, sum(x, {0}), x.size(0)); },
      [](const std::vector<Tensor>& xs, int) {
        Tensor all = cat(xs);
        return sum(all, {0}) / double(all.size(0));
      });
  auto errors = run_ranks(1, [](ProcessGroup& g) {
    // One rank: the tensor count's bits (f32 sums, counts 0, 1 and 7).
    const Tensor s = sin(arange(0.0, 5.0, 1.0) * 0.37f);
    for (const int64_t n : {0, 1, 7})
      CHECK(fn::global_mean(g, s, n).to_vector<float>() ==
            fn::global_mean(g, s, scalar(double(n))).to_vector<float>());
    CHECK_THROWS_WITH_AS(fn::global_mean(g, s, int64_t{-1}),
                         "[dist::fn::global_mean] count must not be negative, got -1",
                         std::invalid_argument);
  });
  CHECK(all_ok(errors));
}

TEST_CASE("rank-consistent random streams: shared agree on every rank without communication") {
  std::vector<std::vector<uint32_t>> shared(kRanks), stepped(kRanks), own(kRanks);
  std::vector<uint64_t> seqs(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    Generator s = shared_generator(g, "rvq.dropout");
    std::vector<uint32_t> a(8), b(8);
    s.fill_u32(a.data(), 8);
    s.fill_u32(b.data(), 8);  // counted per call: the second draw differs
    CHECK(a != b);
    shared[g.rank()] = a;
    // An extra draw on rank 0 (e.g. a logging forward) does not shift a
    // step-keyed stream.
    Generator extra = shared_generator(g, "vq.expire", 5);
    if (g.rank() == 0) extra.fill_u32(a.data(), 8);
    Generator at5 = shared_generator(g, "vq.expire", 5);
    stepped[g.rank()].resize(4);
    at5.fill_u32(stepped[g.rank()].data(), 4);
    Generator mine = rank_generator(g, "data.order");
    own[g.rank()].resize(4);
    mine.fill_u32(own[g.rank()].data(), 4);
    seqs[g.rank()] = g.sequence();
  });
  REQUIRE(all_ok(errors));
  for (int r = 1; r < kRanks; ++r) {
    CHECK(shared[r] == shared[0]);
    CHECK(stepped[r] == stepped[0]);
    CHECK(own[r] != own[0]);
    CHECK(seqs[r] == 0);  // no collective was issued
  }
  // Same seed, same name: a single process reproduces the ranks' stream.
  auto single = ProcessGroup::single({.seed = 1234});
  std::vector<uint32_t> a(8);
  shared_generator(*single, "rvq.dropout").fill_u32(a.data(), 8);
  CHECK(a == shared[0]);
}

namespace {
std::vector<uint32_t> draw(Generator g, int64_t n = 8) {
  std::vector<uint32_t> out(n);
  g.fill_u32(out.data(), n);
  return out;
}
}  // namespace

TEST_CASE("random streams are counted per call: each call continues to a new range") {
  constexpr int kCalls = 4;
  // calls[r][k]: what rank r drew from its k-th shared_generator("mask") call.
  std::vector<std::vector<std::vector<uint32_t>>> calls(kRanks), own(kRanks);
  std::vector<std::vector<uint32_t>> stepped(kRanks), step0(kRanks);
  std::vector<PhiloxOffset> offsets(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    // Rank 1 first uses a step-keyed stream of the same name and other
    // names' counted streams: neither moves the "mask" count.
    if (g.rank() == 1) {
      draw(shared_generator(g, "mask", 3));
      draw(shared_generator(g, "other"));
      draw(rank_generator(g, "mask"));
    }
    for (int k = 0; k < kCalls; ++k) {
      Generator gen = shared_generator(g, "mask");
      if (k == 2) offsets[g.rank()] = gen.offset();
      calls[g.rank()].push_back(draw(gen));
      own[g.rank()].push_back(draw(rank_generator(g, "noise")));
    }
    // The explicit step ignores every earlier call and draw.
    stepped[g.rank()] = draw(shared_generator(g, "mask", 3));
    step0[g.rank()] = draw(shared_generator(g, "mask", 0));
    // Clones count with their group: the next call is the kCalls-th.
    Generator next = Generator::named(g.seed(), "mask");
    next.set_offset({0, kCalls});
    auto twin = g.clone("twin");
    CHECK(draw(shared_generator(*twin, "mask")) == draw(next));
    next.set_offset({0, kCalls + 1});
    CHECK(draw(shared_generator(g, "mask")) == draw(next));
    CHECK(g.sequence() == 0);  // no collective
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(r);
    CHECK(offsets[r] == PhiloxOffset{0, 2});  // the k-th call starts at {0, k}
    for (int k = 0; k < kCalls; ++k) {
      CHECK(calls[r][k] == calls[0][k]);  // the same on every rank
      for (int j = 0; j < k; ++j) {
        CHECK(calls[r][k] != calls[r][j]);  // a new range each call
        CHECK(own[r][k] != own[r][j]);
      }
      if (r > 0) CHECK(own[r][k] != own[0][k]);  // rank streams differ per rank
    }
    CHECK(stepped[r] == stepped[0]);
    // Step s and the s-th counted call are different streams.
    CHECK(stepped[r] != calls[r][3]);
    CHECK(step0[r] != calls[r][0]);
  }
  // A world of one with the same seed makes the same calls and draws the same.
  auto single = ProcessGroup::single({.seed = 1234});
  for (int k = 0; k < kCalls; ++k) CHECK(draw(shared_generator(*single, "mask")) == calls[0][k]);
  CHECK(draw(shared_generator(*single, "mask", 3)) == stepped[0]);
}
