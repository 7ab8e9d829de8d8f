// The failure classes of docs/design.md on real ranks: one rank skips a
// collective, calls a different one, passes another shape, is slow, is lost.
// Every case must end with a clear error on every live rank (or succeed, for
// the slow rank), never a hang or an abort. Timeouts are short (~1 s).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "dist/process_group.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

GroupOptions opts(bool debug, int timeout_ms = 1000) {
  GroupOptions o;
  o.debug = debug ? 1 : 0;
  o.timeout = Millis(timeout_ms);
  return o;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("one rank skips a collective: every rank raises, naming what the others were doing") {
  for (bool debug : {false, true}) {
    CAPTURE(debug);
    auto errors = run_ranks(
        2,
        [](ProcessGroup& g) {
          Tensor a = full({4}, 1.0), b = full({4}, 2.0);
          if (g.rank() == 0) g.all_reduce(a);  // rank 1 skips this one
          g.all_reduce(b);
          g.barrier();
        },
        opts(debug));
    REQUIRE(!errors[0].empty());
    REQUIRE(!errors[1].empty());
    // Caught at the first collective: in debug mode before any data moved,
    // without it by the check carried inside the payload (the two calls
    // have the same shape and would pair, but come from different lines).
    for (int r = 0; r < 2; ++r) {
      CAPTURE(errors[r]);
      CHECK(contains(errors[r], "all_reduce #0"));
      CHECK(contains(errors[r], "rank 0 and rank 1 differ in call site"));
    }
  }
}

// Rank 0 makes one extra all_reduce of the same shape.
// Without the always-on check it paired with rank 1's real one, rank 1
// returned [3, 3, 102, 3, 3] (rank 0's extra values in its sum) and exited 0.
TEST_CASE("without debug, an extra same-shape all_reduce fails on both ranks with a DistError") {
  std::vector<int> dist_errors(2, 0);
  auto errors = run_ranks(
      2,
      [&](ProcessGroup& g) {
        Tensor extra = from_vector<float>({1, 1, 100, 1, 1}, {5});
        Tensor x = full({5}, g.rank() + 1.0);
        try {
          if (g.rank() == 0) g.all_reduce(extra);  // the extra call
          g.all_reduce(x);
        } catch (const DistError&) {
          dist_errors[g.rank()] = 1;
          throw;
        }
        // Never reached: rank 1 used to print [3, 3, 102, 3, 3] here.
        std::printf("rank %d returned %s\n", g.rank(), x.str().c_str());
      },
      opts(false));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "all_reduce #0 (f32 [5], sum)"));
    CHECK(contains(errors[r], "ranks called different collectives"));
    CHECK(contains(errors[r], "rank 0 and rank 1 differ in call site"));
    CHECK(dist_errors[r] == 1);
  }
}

TEST_CASE("the always-on check catches a reduction from another line for every dtype and op") {
  const std::vector<DType> all_dtypes = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                         DType::i32, DType::i64, DType::u8,   DType::boolean};
  for (const int n : {2, 3}) {
    for (DType dt : all_dtypes) {
      // Three ranks (rank 2 alone differs): a few dtypes are enough.
      if (n == 3 && dt != DType::f32 && dt != DType::u8 && dt != DType::boolean) continue;
      for (ReduceOp op :
           {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod}) {
        if (op == ReduceOp::avg && !dtype_info(dt).is_floating) continue;
        if (dt == DType::boolean && op != ReduceOp::min && op != ReduceOp::max) continue;
        for (const bool scatter : {false, true}) {
          CAPTURE(n);
          CAPTURE(dtype_name(dt));
          CAPTURE(reduce_op_name(op));
          CAPTURE(scatter);
          auto errors = run_ranks(
              n,
              [&](ProcessGroup& g) {
                Tensor t = ones({2 * n}, {.dtype = dt});
                const bool odd_one = g.rank() == n - 1;
                if (scatter) {
                  if (odd_one)
                    g.reduce_scatter(t, op);
                  else
                    g.reduce_scatter(t, op);
                } else if (odd_one) {
                  g.all_reduce(t, op);
                } else {
                  g.all_reduce(t, op);
                }
              },
              opts(false));
          for (int r = 0; r < n; ++r) {
            CAPTURE(errors[r]);
            CHECK(contains(errors[r], "differ in call site"));
          }
        }
      }
    }
  }
}

TEST_CASE("the always-on check catches every collective from another line, small and large") {
  using Body = std::function<void(ProcessGroup&, const Tensor&, bool)>;
  const std::vector<std::pair<const char*, Body>> cases = {
      {"all_reduce",
       [](ProcessGroup& g, const Tensor& t, bool other) {
         if (other)
           g.all_reduce(t);
         else
           g.all_reduce(t);
       }},
      {"broadcast",
       [](ProcessGroup& g, const Tensor& t, bool other) {
         if (other)
           g.broadcast(t, 0);
         else
           g.broadcast(t, 0);
         g.barrier();  // the root of a small broadcast learns of it here
       }},
      {"all_gather",
       [](ProcessGroup& g, const Tensor& t, bool other) {
         if (other)
           g.all_gather(t);
         else
           g.all_gather(t);
       }},
      {"all_gather_v",
       [](ProcessGroup& g, const Tensor& t, bool other) {
         if (other)
           g.all_gather_v(t);
         else
           g.all_gather_v(t);
       }},
      {"reduce_scatter",
       [](ProcessGroup& g, const Tensor& t, bool other) {
         if (other)
           g.reduce_scatter(t);
         else
           g.reduce_scatter(t);
       }},
      {"all_to_all",
       [](ProcessGroup& g, const Tensor& t, bool other) {
         if (other)
           g.all_to_all(t);
         else
           g.all_to_all(t);
       }},
      {"barrier",
       [](ProcessGroup& g, const Tensor&, bool other) {
         if (other)
           g.barrier();
         else
           g.barrier();
       }},
  };
  // 4 KB takes the check inside the payload; 2 MiB the fingerprints round
  // the ring beside the data (all_reduce: the region as a second message of
  // the two-rank exchange).
  for (const int64_t numel : {int64_t(1024), int64_t(1) << 19}) {
    for (const auto& [name, body] : cases) {
      CAPTURE(name);
      CAPTURE(numel);
      const Tensor mine = full({numel}, 1.0);
      auto errors = run_ranks(
          2, [&](ProcessGroup& g) { body(g, mine.clone(), g.rank() == 1); }, opts(false));
      // Rank 1 always sees it in the call; so does rank 0, except as the
      // root of a broadcast, which fails at its next call instead.
      CHECK(contains(errors[1], std::string(name) + " #0"));
      CHECK(contains(errors[1], "rank 0 and rank 1 differ in call site"));
      CHECK(!errors[0].empty());
      if (std::string(name) != "broadcast")
        CHECK(contains(errors[0], "rank 0 and rank 1 differ in call site"));
    }
  }
}

TEST_CASE("ranks that issue one collective from two lines pass the same call site") {
  auto errors = run_ranks(
      2,
      [](ProcessGroup& g) {
        // Without the shared site the always-on check would refuse this.
        const ProcessGroup::Site site = ProcessGroup::Site::current();
        Tensor x = full({4}, 7.0), y = zeros({4});
        if (g.rank() == 0) {
          g.broadcast(x, 0, {}, site);
        } else {
          g.broadcast(y, 0, {}, site);
          CHECK(y.to_vector<float>() == std::vector<float>(4, 7.0f));
        }
      },
      opts(false));
  CHECK(all_ok(errors));
}

TEST_CASE("one rank calls a different collective") {
  for (bool debug : {false, true}) {
    CAPTURE(debug);
    auto errors = run_ranks(
        3,
        [](ProcessGroup& g) {
          Tensor x = full({8}, 1.0);
          if (g.rank() == 2)
            g.broadcast(x, 0);
          else
            g.all_reduce(x);
        },
        opts(debug));
    for (int r = 0; r < 3; ++r) {
      CAPTURE(errors[r]);
      CHECK(!errors[r].empty());
    }
    if (debug) {
      CHECK(contains(errors[0], "op all_reduce vs broadcast"));
      CHECK(contains(errors[2], "op all_reduce vs broadcast"));
    } else {
      CHECK(contains(errors[0], "rank 2 was in broadcast #0"));
      CHECK(contains(errors[2], "rank 0 was in all_reduce #0"));
    }
  }
}

TEST_CASE("shapes differ (9331 vs 9330 rows): an error on every rank, not Gloo's abort") {
  for (bool debug : {false, true}) {
    CAPTURE(debug);
    auto errors = run_ranks(
        2,
        [](ProcessGroup& g) {
          Tensor x = zeros({g.rank() == 0 ? 9331 : 9330, 4});
          g.all_reduce(x);
        },
        opts(debug));
    for (int r = 0; r < 2; ++r) {
      CAPTURE(errors[r]);
      CHECK(contains(errors[r], debug ? "shape f32 [9331, 4] vs f32 [9330, 4]" : "[9330, 4]"));
    }
  }
}

TEST_CASE("dtypes differ in debug mode") {
  auto errors = run_ranks(
      2,
      [](ProcessGroup& g) {
        Tensor x = zeros({4}, {.dtype = g.rank() ? DType::f64 : DType::f32});
        g.all_gather(x);
      },
      opts(true));
  CHECK(contains(errors[0], "dtype f32 vs f64"));
  CHECK(contains(errors[1], "dtype f32 vs f64"));
}

TEST_CASE("a rank that never arrives: the others time out naming it, and it fails at once later") {
  auto errors = run_ranks(
      3,
      [](ProcessGroup& g) {
        Tensor x = full({4}, 1.0);
        if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
        g.all_reduce(x);
      },
      opts(false));
  CHECK(contains(errors[0], "all_reduce #0"));
  CHECK(contains(errors[0], "ranks that did not arrive: 1"));
  CHECK(contains(errors[2], "ranks that did not arrive: 1"));
  CHECK(!errors[1].empty());  // arrives late to a group that has given up
}

TEST_CASE("a slow rank within the timeout succeeds") {
  auto errors = run_ranks(
      2,
      [](ProcessGroup& g) {
        Tensor x = full({4}, g.rank() + 1.0);
        if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
        g.all_reduce(x);
        CHECK(x.to_vector<float>()[0] == 3.0f);
        g.barrier();
      },
      opts(true, 2000));
  CHECK(all_ok(errors));
}

TEST_CASE("per-call timeout overrides the group's") {
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2,
      [](ProcessGroup& g) {
        if (g.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1500));
          return;
        }
        g.barrier({.timeout = Millis(300)});
      },
      opts(false, 10000));
  const auto ms = std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - t0).count();
  CHECK(contains(errors[0], "barrier #0"));
  REQUIRE(contains(errors[0], " ms: "));
  // ~300 ms, not the group's 10 s (generous: the machine may be loaded)
  const auto at = errors[0].find(" after ") + 7;
  CHECK(std::stol(errors[0].substr(at)) < 3000);
  CHECK(ms < 5000);
}

TEST_CASE("a rank that left the group is named as such; a broken group fails at once") {
  auto errors = run_ranks(
      2,
      [](ProcessGroup& g) {
        if (g.rank() == 1) return;  // leaves (destroys its group) without the barrier
        try {
          g.barrier();
        } catch (const DistError& e) {
          CHECK(contains(e.what(), "rank 1 left the group after 0 collectives"));
        }
        const auto t0 = std::chrono::steady_clock::now();
        Tensor x = zeros({2});
        CHECK_THROWS_WITH_AS(g.all_reduce(x), doctest::Contains("the group is broken"), DistError);
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(100));
      },
      opts(false));
  CHECK(all_ok(errors));
}
