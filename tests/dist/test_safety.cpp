// The failure classes of DESIGN.md on real ranks: one rank skips a
// collective, calls a different one, passes another shape, is slow, is lost.
// Every case must end with a clear error on every live rank (or succeed, for
// the slow rank), never a hang or an abort. Timeouts are short (~1 s).
#include <doctest/doctest.h>

#include <chrono>
#include <thread>

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
    if (debug) {
      // Caught at the first collective, before any data moved.
      CHECK(contains(errors[0], "all_reduce #0"));
      CHECK(contains(errors[0], "call site"));
      CHECK(contains(errors[1], "rank 0 and rank 1 differ"));
    } else {
      // The skipped call mis-pairs silently (same shape); the next one cannot
      // pair and both ranks report what the other was in.
      CHECK(contains(errors[0], "all_reduce #1"));
      CHECK(contains(errors[0], "rank 1 was in barrier #1"));
      CHECK(contains(errors[1], "rank 0 was in all_reduce #1"));
    }
  }
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
