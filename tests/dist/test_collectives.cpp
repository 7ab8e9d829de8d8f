// Collectives on real ranks (threads over Gloo on loopback): results on
// every dtype where they make sense, zero-size tensors, world of one, and
// the errors for what cannot work.
#include <doctest/doctest.h>

#include <csignal>
#include <map>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

// rank r's tensor: values r + 1 + i (i the flat index), in `dtype`.
Tensor rank_tensor(int r, const Shape& shape, DType dtype) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return (arange(0.0, double(n), 1.0, {.dtype = DType::f64}) + double(r + 1))
      .reshape(shape)
      .to(dtype);
}

// Element x of rank_tensor on ranks 0, 1 and 2 (x + 1, x + 2, x + 3) reduced by `op`.
double three_ranks(ReduceOp op, double x) {
  switch (op) {
    case ReduceOp::min:
      return x + 1;
    case ReduceOp::max:
      return x + 3;
    case ReduceOp::avg:
      return x + 2;
    case ReduceOp::sum:
      return 3 * x + 6;
    default:  // prod
      return (x + 1) * (x + 2) * (x + 3);
  }
}

}  // namespace

TEST_CASE(
    "all_reduce: sum, avg, min, max, prod on every arithmetic dtype, bitwise equal on all ranks") {
  // Two ranks take the pairwise exchange, three the ring.
  for (const int n : {2, 3}) {
    CAPTURE(n);
    for (DType dt :
         {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
      for (ReduceOp op :
           {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod}) {
        if (op == ReduceOp::avg && !is_floating(dt)) continue;
        CAPTURE(dtype_name(dt));
        CAPTURE(reduce_op_name(op));
        std::vector<std::vector<double>> got(n);
        auto errors = run_ranks(n, [&](ProcessGroup& g) {
          Tensor t = rank_tensor(g.rank(), {2, 3}, dt);
          g.all_reduce(t, op);
          got[g.rank()] = t.to_vector<double>();
        });
        REQUIRE(all_ok(errors));
        for (int64_t i = 0; i < 6; ++i) {
          double a = 1 + i, b = 2 + i, c = n == 3 ? 3 + i : 0;
          double want = op == ReduceOp::sum   ? a + b + c
                        : op == ReduceOp::avg ? (a + b + c) / n
                        : op == ReduceOp::min ? a
                        : op == ReduceOp::max ? (n == 3 ? c : b)
                                              : a * b * (n == 3 ? c : 1);
          if (dt == DType::u8) want = double(uint8_t(int64_t(want)));
          const double tol = (dt == DType::bf16 || dt == DType::f16) ? 0.02 * std::abs(want) : 1e-6;
          CHECK(got[0][i] == doctest::Approx(want).epsilon(tol));
          for (int r = 1; r < n; ++r) CHECK(got[r][i] == got[0][i]);
        }
      }
    }
  }
}

TEST_CASE("a group ignores SIGPIPE, so a peer gone mid-write is reported, not fatal") {
  // Writing to a socket whose peer has closed raises SIGPIPE; by default it
  // killed the whole test process when one rank left while another sent
  // (seen in QuantizerSync's crashed-rank test on a loaded machine).
  auto errors = run_ranks(2, [](ProcessGroup& g) { g.barrier(); });
  CHECK(all_ok(errors));
  struct sigaction now {};
  REQUIRE(sigaction(SIGPIPE, nullptr, &now) == 0);
  CHECK((now.sa_handler == SIG_IGN));
}

TEST_CASE("all_reduce on two ranks: exact sums on both sides of the pairwise limit") {
  // Rank 0 holds i, rank 1 holds 2^24 - i: every sum is 2^24, exact in f32,
  // so any mis-paired or half-reduced block shows. Sizes straddle the
  // exchange's limit (4 MiB) and the ring's segments.
  // (1 << 18: 1 MiB, the check region as a second message of the exchange.)
  for (const int64_t numel : {int64_t(1), int64_t(1000), int64_t(1) << 18, int64_t(1) << 20,
                              (int64_t(1) << 20) + 1, int64_t(3) << 20}) {
    CAPTURE(numel);
    std::vector<Tensor> out(2);
    auto errors = run_ranks(2, [&](ProcessGroup& g) {
      Tensor idx = arange(0.0, double(numel), 1.0);
      Tensor t = g.rank() == 0 ? idx : full({numel}, double(1 << 24)) - idx;
      g.all_reduce(t);
      out[size_t(g.rank())] = t;
    });
    REQUIRE(all_ok(errors));
    CHECK(all(eq(out[0], full({numel}, double(1 << 24)))).item() == 1.0);
    CHECK(all(eq(out[1], out[0])).item() == 1.0);
  }
}

TEST_CASE("all_reduce on a strided view writes back through the view") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Tensor base = zeros({3, 4}, {.dtype = DType::f64});
    Tensor col = base.select(1, 1);  // non-contiguous
    copy_(col, full({3}, g.rank() + 1.0, {.dtype = DType::f64}));
    g.all_reduce(col);
    CHECK(base.to_vector<double>() == std::vector<double>{0, 3, 0, 0, 0, 3, 0, 0, 0, 3, 0, 0});
  });
  CHECK(all_ok(errors));
}

TEST_CASE("connect: a GPU's transport made up front; nothing to make on the CPU or sim") {
  std::vector<Tensor> out(2);
  std::vector<std::string> gpu_errors(2);
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    auto clone = g.clone("worker");
    clone->connect(Device::cpu());
    clone->connect(Device::sim(0));
    Tensor t = full({3}, g.rank() + 1.0);
    clone->all_reduce(t);  // the clone still reduces, in its own sequence
    out[size_t(g.rank())] = t;
    if (!cuda_built()) {
      try {
        g.connect(Device::cuda(0));
      } catch (const std::invalid_argument& e) {
        gpu_errors[size_t(g.rank())] = e.what();
      }
    }
  });
  REQUIRE(all_ok(errors));
  CHECK(out[0].to_vector<float>() == std::vector<float>{3, 3, 3});
  CHECK(out[1].to_vector<float>() == std::vector<float>{3, 3, 3});
  if (!cuda_built())
    for (const std::string& e : gpu_errors)
      CHECK(e == "[dist::connect] cuda:0, but quanta was built without CUDA");
  CHECK_NOTHROW(ProcessGroup::single()->connect(Device::cuda(0)));  // a group of one: no transport
}

TEST_CASE("reductions refuse byte-only and unsuitable dtypes before any communication") {
  auto g = ProcessGroup::single();
  Tensor b = zeros({4}, {.dtype = DType::boolean});
  CHECK_THROWS_WITH_AS(g->all_reduce(b, ReduceOp::sum),
                       doctest::Contains("bool tensors reduce only"), std::invalid_argument);
  Tensor i = zeros({4}, {.dtype = DType::i32});
  CHECK_THROWS_WITH_AS(g->all_reduce(i, ReduceOp::avg),
                       doctest::Contains("avg needs a floating dtype"), std::invalid_argument);
  CHECK_NOTHROW(g->all_reduce(b, ReduceOp::max));
  CHECK(g->sequence() == 1);  // refused calls did not count
}

TEST_CASE("broadcast, all_gather, all_gather_v and all_to_all move bytes of any dtype") {
  const int n = 3;
  for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::u8, DType::boolean}) {
    CAPTURE(dtype_name(dt));
    auto errors = run_ranks(n, [&](ProcessGroup& g) {
      const int r = g.rank();
      Tensor x = rank_tensor(r, {2, 2}, dt);
      g.broadcast(x, 1);
      CHECK(x.to_vector<double>() == rank_tensor(1, {2, 2}, dt).to_vector<double>());

      Tensor all = g.all_gather(rank_tensor(r, {1, 2}, dt));
      CHECK(all.shape() == Shape{3, 2});
      CHECK(all.to_vector<double>() == cat({rank_tensor(0, {1, 2}, dt), rank_tensor(1, {1, 2}, dt),
                                            rank_tensor(2, {1, 2}, dt)})
                                           .to_vector<double>());

      // uneven: rank r has r rows (rank 0 none)
      std::vector<int64_t> sizes;
      Tensor v = g.all_gather_v(rank_tensor(r, {r, 2}, dt), &sizes);
      CHECK(sizes == std::vector<int64_t>{0, 1, 2});
      CHECK(v.shape() == Shape{3, 2});
      CHECK(v.to_vector<double>() ==
            cat({rank_tensor(1, {1, 2}, dt), rank_tensor(2, {2, 2}, dt)}).to_vector<double>());

      // all_to_all: block j of rank r is (r, j); afterwards block j holds (j, r)
      if (dt == DType::boolean) {
        // Row j of rank r is {r odd, j odd}: afterwards row j is {j odd, r odd}.
        std::vector<double> mine, want;
        for (int j = 0; j < n; ++j) {
          mine.insert(mine.end(), {double(r % 2), double(j % 2)});
          want.insert(want.end(), {double(j % 2), double(r % 2)});
        }
        Tensor t = g.all_to_all(from_vector<double>(mine, {n, 2}).to(dt));
        CHECK(t.dtype() == DType::boolean);
        CHECK(t.to_vector<double>() == want);
      } else {
        Tensor blocks =
            from_vector<double>({double(r * 10 + 0), double(r * 10 + 1), double(r * 10 + 2)}, {3})
                .to(dt);
        Tensor t = g.all_to_all(blocks);
        CHECK(t.dtype() == dt);
        CHECK(t.to_vector<double>() ==
              std::vector<double>{double(r), double(10 + r), double(20 + r)});
      }
    });
    CHECK(all_ok(errors));
  }
}

TEST_CASE("reduce_scatter: block r of the sum over ranks, sum and avg") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Tensor x = rank_tensor(g.rank(), {4, 2}, DType::f64);  // rank r: r+1 .. r+8
    Tensor s = g.reduce_scatter(x);
    CHECK(s.shape() == Shape{2, 2});
    const int64_t off = g.rank() * 4;
    for (int64_t i = 0; i < 4; ++i) CHECK(s.to_vector<double>()[i] == double(2 * (off + i) + 3));
    Tensor a = g.reduce_scatter(x, ReduceOp::avg);
    for (int64_t i = 0; i < 4; ++i)
      CHECK(a.to_vector<double>()[i] == double(2 * (off + i) + 3) / 2);
  });
  CHECK(all_ok(errors));
}

TEST_CASE("reduce_scatter: min, max, avg, sum and prod on f32 over three ranks") {
  const int n = 3;
  for (ReduceOp op : {ReduceOp::min, ReduceOp::max, ReduceOp::avg, ReduceOp::sum, ReduceOp::prod}) {
    CAPTURE(reduce_op_name(op));
    std::vector<std::vector<float>> got(n);
    auto errors = run_ranks(n, [&](ProcessGroup& g) {
      // rank r holds r + 1 + i; block b is rows 2b, 2b + 1 (i = 4b .. 4b + 3)
      Tensor s = g.reduce_scatter(rank_tensor(g.rank(), {6, 2}, DType::f32), op);
      CHECK(s.shape() == Shape{2, 2});
      CHECK(s.dtype() == DType::f32);
      got[g.rank()] = s.to_vector<float>();
    });
    REQUIRE(all_ok(errors));
    for (int r = 0; r < n; ++r)
      for (int64_t k = 0; k < 4; ++k) {
        const double x = double(4 * r + k);  // element index in the full tensor
        CHECK(got[r][k] == float(three_ranks(op, x)));
      }
  }
}

TEST_CASE("reduce: every op into the root over three ranks; the others keep their values") {
  const int n = 3;
  for (ReduceOp op : {ReduceOp::min, ReduceOp::max, ReduceOp::avg, ReduceOp::sum, ReduceOp::prod})
    for (int root : {0, 2}) {
      CAPTURE(reduce_op_name(op));
      CAPTURE(root);
      std::vector<std::vector<float>> got(n);
      auto errors = run_ranks(n, [&](ProcessGroup& g) {
        // Non-contiguous on purpose: the reduced values come back through a copy.
        Tensor x = rank_tensor(g.rank(), {3, 2}, DType::f32).t();
        g.reduce(x, root, op);
        got[g.rank()] = x.t().contiguous().to_vector<float>();
      });
      REQUIRE(all_ok(errors));
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < 6; ++i) {
          const double x = double(i);
          CHECK(got[r][i] == float(r == root ? three_ranks(op, x) : x + 1 + r));
        }
    }
}

TEST_CASE("reduce: a large buffer, and a different call on one rank named on every rank") {
  // 3 MB: past the inline check size, through Gloo's segmented ring.
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Tensor x = full({750000}, double(g.rank() + 1));
    g.reduce(x, 1, ReduceOp::avg);
    const auto v = x.to_vector<float>();
    CHECK(v.front() == (g.rank() == 1 ? 1.5f : 1.0f));
    CHECK(v.back() == (g.rank() == 1 ? 1.5f : 1.0f));
  });
  CHECK(all_ok(errors));
  std::vector<std::string> messages(2);
  run_ranks(2, [&](ProcessGroup& g) {
    try {
      g.reduce(zeros({4}), 0, g.rank() == 0 ? ReduceOp::sum : ReduceOp::max);
    } catch (const std::exception& e) {
      messages[g.rank()] = e.what();
    }
  });
  for (const std::string& m : messages) {
    CHECK(m.find("reduce") != std::string::npos);
    CHECK(m.find("max") != std::string::npos);
  }
  auto one = ProcessGroup::single();
  CHECK_THROWS_WITH_AS(one->reduce(zeros({2}), 1), doctest::Contains("[dist::reduce] root 1"),
                       std::invalid_argument);
}

TEST_CASE("zero-size tensors are normal in every collective") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Tensor e = zeros({0, 3});
    g.all_reduce(e);
    g.broadcast(e, 0);
    CHECK(g.all_gather(e).shape() == Shape{0, 3});
    CHECK(g.all_gather_v(e).shape() == Shape{0, 3});
    CHECK(g.reduce_scatter(zeros({0, 3})).shape() == Shape{0, 3});
    g.reduce(e, 1);
    CHECK(g.all_to_all(e).shape() == Shape{0, 3});
    g.barrier();
  });
  CHECK(all_ok(errors));
}

TEST_CASE("a world of one: every collective is an identity") {
  auto g = ProcessGroup::single({.seed = 7});
  CHECK(g->size() == 1);
  CHECK(g->seed() == 7);
  Tensor x = from_vector<float>({1, 2, 3}, {3});
  g->all_reduce(x, ReduceOp::avg);
  CHECK(x.to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK(g->all_gather(x).to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK(g->all_gather_v(x).to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK(g->reduce_scatter(x).to_vector<float>() == std::vector<float>{1, 2, 3});
  g->barrier();
  CHECK(g->sequence() == 5);
}

TEST_CASE("shape errors are raised locally with the op's name") {
  auto g = ProcessGroup::single();
  CHECK_THROWS_WITH_AS(g->broadcast(zeros({2}), 3), doctest::Contains("[dist::broadcast] root 3"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(g->all_gather_v(scalar(1.0)), doctest::Contains("[dist::all_gather_v]"),
                       std::invalid_argument);
}

TEST_CASE("clone: a second group over the same ranks with its own sequence") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    auto g2 = g.clone("grads");
    Tensor x = full({3}, 1.0);
    g2->all_reduce(x);
    g.all_reduce(x);
    CHECK(x.to_vector<float>() == std::vector<float>{4, 4, 4});
    CHECK(g2->sequence() == 1);
    CHECK(g2->seed() == g.seed());
  });
  CHECK(all_ok(errors));
}

TEST_CASE(
    "debug mode: small all_reduces carry their data with the fingerprint, large ones do not") {
  GroupOptions o;
  o.debug = 1;
  for (int64_t n : {int64_t(3), int64_t(1024), int64_t(1025),
                    int64_t(5000)}) {  // 4 KB is the fused limit for f32
    CAPTURE(n);
    std::vector<std::vector<float>> got(3);
    auto errors = run_ranks(
        3,
        [&](ProcessGroup& g) {
          Tensor x = rank_tensor(g.rank(), {n}, DType::f32);
          Tensor y = x.clone(), z = x.clone();
          g.all_reduce(x, ReduceOp::sum);
          g.all_reduce(y, ReduceOp::max);
          g.all_reduce(z, ReduceOp::avg);
          CHECK(x.to_vector<float>()[0] == 6.0f);
          CHECK(y.to_vector<float>()[n - 1] == float(n + 2));
          CHECK(z.to_vector<float>()[1] == 3.0f);
          got[g.rank()] = x.to_vector<float>();
        },
        o);
    REQUIRE(all_ok(errors));
    CHECK(got[1] == got[0]);
    CHECK(got[2] == got[0]);
  }
}

// A CallProfile (engine/profile/call_profile.h) times each collective from
// its call to its return, a row per op beside the kernel tables' rows, and
// keeps them out of the tables' totals: DataParallel's run beside the step.
TEST_CASE("a call profile's rows of collectives, outside the tables' totals") {
  std::vector<Tensor> got(2);
  CallProfile p;
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Tensor x = full({8}, double(g.rank() + 1));
    for (int i = 0; i < 3; ++i) g.all_reduce(x, ReduceOp::sum);
    g.broadcast(x, 1);
    got[static_cast<std::size_t>(g.rank())] = x;
  });
  p.stop();
  REQUIRE(all_ok(errors));
  CHECK(got[0].to_vector<float>() == std::vector<float>(8, 12.0f));  // (1 + 2) * 2 * 2
  std::map<std::string, CallProfileRow> rows;
  for (const CallProfileRow& r : p.rows()) rows[r.name] = r;
  REQUIRE(rows.count("dist.all_reduce") == 1);
  CHECK(rows["dist.all_reduce"].calls == 6);  // 3 a rank
  CHECK(rows["dist.all_reduce"].device == DeviceType::cpu);
  CHECK(rows["dist.all_reduce"].seconds > 0);
  REQUIRE(rows.count("dist.broadcast") == 1);
  CHECK(rows["dist.broadcast"].calls >= 2);
  // The totals hold the tables' outermost calls only.
  int64_t table_calls = 0;
  for (const auto& [name, r] : rows)
    if (name.rfind("dist.", 0) != 0) table_calls += r.calls;
  CHECK(p.calls() <= table_calls);
}
