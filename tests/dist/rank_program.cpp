// A small distributed program for the process tests and the launcher test:
// it joins the group from the environment (dist::init) and runs a scenario.
//   ok    all_reduce of rank + 1; prints "rank R of N: sum S"
//   die   one all_reduce, then rank 1 exits abruptly (_exit(3)) and the other
//         ranks try another all_reduce: they print the error and how long it took
//   fail  rank 1 exits with status 7 at once; the others sleep 60 s (the
//         launcher must stop them)
//   die_in_step  DataParallel on a sim device: one step, then rank 1 exits
//         abruptly after the next forward; the others' gradient reduction
//         (on the communication thread, from device buckets) must fail and
//         say so at finish_step, printed as for `die`
//   die_in_gather  ShardedUnits on a sim device: the first unit's forward
//         (its gather, and the next unit's prefetch), then rank 1 exits
//         abruptly; the others' next forwards must fail at a gather, printed
//         as for `die`
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "dist/data_parallel.h"
#include "dist/env.h"
#include "dist/sharded_units.h"
#include "quanta.h"

using namespace quanta;

namespace {
// A unit whose buffer is sharded.
class Unit : public Module {
 public:
  explicit Unit(Device dev) : Module("Unit") {
    register_buffer("codes", full({4096}, 3.0, {.device = dev}));
  }
  Tensor forward(const Tensor& x) override { return x; }
};

// Runs `step`, which must fail with a DistError: prints how long that took
// and the error ("ERROR after N ms: ..."), exit status 0; else "NO ERROR", 1.
template <class Step>
int expect_failure(Step&& step) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    step();
    std::printf("NO ERROR\n");
    return 1;
  } catch (const dist::DistError& e) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    std::printf("ERROR after %lld ms: %s\n", static_cast<long long>(ms), e.what());
    return 0;
  }
}
}  // namespace

int main(int argc, char** argv) {
  const char* scenario = argc > 1 ? argv[1] : "ok";
  try {
    dist::GroupOptions opts;
    opts.timeout = dist::Millis(10000);
    auto g = dist::init(opts);
    Tensor x = full({4}, g->rank() + 1.0);
    if (std::strcmp(scenario, "ok") == 0) {
      g->all_reduce(x);
      std::printf("rank %d of %d: sum %g\n", g->rank(), g->size(), x.to_vector<float>()[0]);
      return 0;
    }
    if (std::strcmp(scenario, "die") == 0) {
      g->all_reduce(x);
      if (g->rank() == 1) _exit(3);
      return expect_failure([&] { g->all_reduce(x); });
    }
    if (std::strcmp(scenario, "die_in_step") == 0) {
      const Device sim = Device::sim();
      Generator gen(5);
      auto model = std::make_shared<Linear>(4, 3, gen);
      model->to(sim);
      dist::DataParallel dp(model, *g);
      const Tensor input = full({2, 4}, g->rank() + 1.0, {.device = sim});
      sum(dp(input)).backward();
      dp.finish_step();
      const Tensor out = dp(input);
      if (g->rank() == 1) _exit(3);
      return expect_failure([&] {
        sum(out).backward();
        dp.finish_step();
      });
    }
    if (std::strcmp(scenario, "die_in_gather") == 0) {
      const Device sim = Device::sim();
      Module root("Root");
      auto a = root.register_module("a", std::make_shared<Unit>(sim));
      auto b = root.register_module("b", std::make_shared<Unit>(sim));
      dist::ShardedUnits units(root, *g, {"a", "b"});
      (*a)(x);
      if (g->rank() == 1) _exit(3);
      return expect_failure([&] {
        for (int i = 0; i < 4; ++i) (*(i % 2 ? a : b))(x);
      });
    }
    if (std::strcmp(scenario, "fail") == 0) {
      if (g->rank() == 1) {
        std::fprintf(stderr, "rank 1 fails on purpose\n");
        return 7;
      }
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    std::fprintf(stderr, "unknown scenario %s\n", scenario);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank_program: %s\n", e.what());
    return 1;
  }
}
