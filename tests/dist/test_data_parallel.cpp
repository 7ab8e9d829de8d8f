// DataParallel on thread ranks: N ranks with the batch split equal one
// process on the whole batch over several optimizer steps (f64); model
// mismatches, unused parameters, no_sync, ignored parameters, buffers and
// step hooks; gradients reduced into their owners (with OptimizerShards).
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <set>

#include "dist/data_parallel.h"
#include "dist/optimizer_shards.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

constexpr int kRanks = 2;
const TensorOptions f64{.dtype = DType::f64};

struct TwoHeads : Module {
  std::shared_ptr<Linear> body, a, b;
  Tensor count;
  bool use_b = true;
  TwoHeads(uint64_t seed, int64_t hidden = 6, int64_t count_size = 1) : Module("TwoHeads") {
    Generator gen(seed);
    body = register_module("body", std::make_shared<Linear>(4, hidden, gen));
    a = register_module("a", std::make_shared<Linear>(hidden, 2, gen));
    b = register_module("b", std::make_shared<Linear>(hidden, 2, gen));
    count = register_buffer("count", zeros({count_size}));
    to(DType::f64);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = tanh(body->forward(x));
    Tensor y = a->forward(h);
    return use_b ? y + b->forward(h) : y;
  }
};

Tensor batch_x(int64_t rows, int64_t offset) {
  return sin(arange(0.0, double(rows * 4), 1.0, f64).reshape({rows, 4}) * 0.37 + double(offset));
}
Tensor batch_y(int64_t rows, int64_t offset) {
  return cos(arange(0.0, double(rows * 2), 1.0, f64).reshape({rows, 2}) * 0.53 + double(offset));
}

std::vector<std::vector<double>> values(Module& m) {
  std::vector<std::vector<double>> out;
  for (auto& p : m.parameters()) out.push_back(p.to_vector<double>());
  return out;
}

void check_close(const std::vector<std::vector<double>>& a,
                 const std::vector<std::vector<double>>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t j = 0; j < a[i].size(); ++j)
      CHECK(a[i][j] == doctest::Approx(b[i][j]).epsilon(1e-11));
}

}  // namespace

TEST_CASE("N ranks with the batch split equal one process on the whole batch") {
  const int steps = 4;
  const int64_t local = 3;
  for (std::size_t bucket_bytes : {std::size_t(25) << 20, std::size_t(64)}) {
    CAPTURE(bucket_bytes);
    // One process, whole batch, rank 0's initialisation.
    auto ref = std::make_shared<TwoHeads>(100);
    SGD ref_opt(ref->parameters(), {.lr = 0.1});
    for (int s = 0; s < steps; ++s) {
      Tensor loss = mse_loss(ref->forward(batch_x(local * kRanks, s)), batch_y(local * kRanks, s));
      loss.backward();
      ref_opt.step();
      ref_opt.zero_grad();
    }
    std::vector<std::vector<std::vector<double>>> got(kRanks);
    std::vector<std::size_t> buckets(kRanks);
    auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
      auto model = std::make_shared<TwoHeads>(100 + g.rank());  // different inits: rank 0's wins
      DataParallel dp(model, g, {.bucket_bytes = bucket_bytes});
      buckets[g.rank()] = dp.num_buckets();
      SGD opt(model->parameters(), {.lr = 0.1});
      for (int s = 0; s < steps; ++s) {
        Tensor x = batch_x(local * kRanks, s).narrow(0, local * g.rank(), local);
        Tensor y = batch_y(local * kRanks, s).narrow(0, local * g.rank(), local);
        mse_loss(dp(x), y).backward();
        dp.finish_step();
        opt.step();
        opt.zero_grad();
      }
      got[g.rank()] = values(*model);
    });
    REQUIRE(all_ok(errors));
    CHECK(buckets[0] == (bucket_bytes == 64 ? 6u : 1u));
    check_close(got[0], values(*ref));
    CHECK(got[1] == got[0]);  // replicas stay bitwise identical
  }
}

TEST_CASE("on a device (sim) the buckets live there, and the result is the CPU's") {
  const int steps = 3;
  const int64_t local = 3;
  auto train = [&](Device dev) {
    std::vector<std::vector<std::vector<double>>> got(kRanks);
    std::vector<std::vector<Device>> where(kRanks);
    auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
      auto model = std::make_shared<TwoHeads>(100 + g.rank());
      model->to(dev);
      DataParallel dp(model, g, {.bucket_bytes = 64});
      for (std::size_t i = 0; i < dp.num_buckets(); ++i)
        where[g.rank()].push_back(dp.bucket_device(i));
      SGD opt(model->parameters(), {.lr = 0.1});
      for (int s = 0; s < steps; ++s) {
        Tensor x = batch_x(local * kRanks, s).narrow(0, local * g.rank(), local).to(dev);
        Tensor y = batch_y(local * kRanks, s).narrow(0, local * g.rank(), local).to(dev);
        mse_loss(dp(x), y).backward();
        dp.finish_step();
        opt.step();
        opt.zero_grad();
      }
      got[g.rank()] = values(*model);
    });
    REQUIRE(all_ok(errors));
    for (const auto& w : where) {
      REQUIRE(w.size() == 6u);
      for (Device d : w) CHECK(d == dev);  // no gradient crosses to the host
    }
    CHECK(got[1] == got[0]);
    return got[0];
  };
  CHECK(train(Device::sim(0)) == train(Device::cpu()));
}

TEST_CASE("a model that differs across ranks: every rank names the first difference") {
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(1, g.rank() == 1 ? 7 : 6);
    DataParallel dp(model, g);
  });
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(errors[r]);
    CHECK(errors[r].find("rank 0 has parameter 'body.weight' f64 [6, 4], rank 1 has parameter "
                         "'body.weight' f64 [7, 4]") != std::string::npos);
  }
}

TEST_CASE("buffers that differ in shape or dtype: every rank names the buffer") {
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(1, 6, g.rank() == 1 ? 3 : 1);
    DataParallel dp(model, g);
  });
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(errors[r]);
    CHECK(errors[r].find("first difference between rank 0 and rank 1: rank 0 has buffer 'count' "
                         "f64 [1], rank 1 has buffer 'count' f64 [3]") != std::string::npos);
  }
  errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(1);
    model->register_buffer("steps", zeros({2}, {.dtype = g.rank() == 1 ? DType::i32 : DType::i64}));
    DataParallel dp(model, g);
  });
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(errors[r]);
    CHECK(errors[r].find("rank 0 has buffer 'steps' i64 [2], rank 1 has buffer 'steps' i32 [2]") !=
          std::string::npos);
  }
}

TEST_CASE("broadcast_buffers=false: buffers follow rank 0 once, then stay local") {
  std::vector<double> at_start(kRanks), after_step(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(30);
    fill_(model->count, 5.0 + g.rank());
    DataParallel dp(model, g, {.broadcast_buffers = false});
    at_start[g.rank()] = model->count.item();  // construction always broadcasts
    fill_(model->count, 10.0 + g.rank());
    for (int step = 0; step < 2; ++step) {
      sum(dp(batch_x(2, g.rank()))).backward();
      dp.finish_step();
      model->zero_grad();
    }
    after_step[g.rank()] = model->count.item();
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < kRanks; ++r) {
    CHECK(at_start[r] == 5.0);
    CHECK(after_step[r] == 10.0 + r);  // each rank's own value
  }
}

TEST_CASE("gradient buckets launch during backward, before its last gradient exists") {
  // One bucket per parameter (64 bytes): buckets 0..5 hold b.bias, b.weight,
  // a.bias, a.weight, body.bias, body.weight (reverse registration order).
  // body's gradients come last in backward; by then the heads' buckets must
  // already be on the communication thread.
  std::vector<std::vector<std::size_t>> seen(kRanks);  // launched, at each gradient
  std::vector<std::size_t> after_backward(kRanks), after_finish(kRanks), buckets(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(8);
    DataParallel* dp_ptr = nullptr;
    // Registered before DataParallel's hooks, so each runs just before the
    // parameter's own gradient is handed to its bucket.
    for (auto& p : model->parameters())
      p.register_post_accumulate_hook(
          [&, r = g.rank()](const Tensor&) { seen[r].push_back(dp_ptr->buckets_launched()); });
    DataParallel dp(model, g, {.bucket_bytes = 64});
    dp_ptr = &dp;
    buckets[g.rank()] = dp.num_buckets();
    for (int step = 0; step < 2; ++step) {
      seen[g.rank()].clear();
      sum(dp(batch_x(3, g.rank()))).backward();
      after_backward[g.rank()] = dp.buckets_launched();
      dp.finish_step();
      after_finish[g.rank()] = dp.buckets_launched();
      model->zero_grad();
    }
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(r);
    REQUIRE(buckets[r] == 6);
    REQUIRE(seen[r].size() == 6);
    CHECK(seen[r].front() == 0);  // nothing before the first gradient
    // When the last gradient arrives, the four head buckets have launched
    // (body.bias's bucket too if body.weight's gradient is the last one).
    CHECK(seen[r].back() >= 4);
    CHECK(seen[r].back() < 6);
    CHECK(std::is_sorted(seen[r].begin(), seen[r].end()));
    CHECK(after_backward[r] == 6);  // everything launched by backward itself
    CHECK(after_finish[r] == 0);    // reset for the next step
  }
}

TEST_CASE("unused parameters: no hang; unused everywhere keeps no gradient") {
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(5);
    DataParallel dp(model, g, {.bucket_bytes = 64});
    for (int step = 0; step < 2; ++step) {
      // Step 0: head b used only on rank 1. Step 1: unused everywhere.
      model->use_b = step == 0 && g.rank() == 1;
      Tensor x = batch_x(2, g.rank());
      Tensor out = dp(x);
      sum(out).backward();
      // What rank 1's own gradient of b.bias is: 2 rows, each d(sum)/d(bias) = 1.
      dp.finish_step();
      if (step == 0) {
        // b.bias: rank 1 contributes 2 per output, rank 0 contributes 0: avg 1.
        CHECK(model->b->find("bias").grad().to_vector<double>() == std::vector<double>{1.0, 1.0});
        // a.bias: both ranks contribute 2: avg 2.
        CHECK(model->a->find("bias").grad().to_vector<double>() == std::vector<double>{2.0, 2.0});
      } else {
        CHECK(!model->b->find("bias").grad().defined());
      }
      model->zero_grad();
    }
  });
  CHECK(all_ok(errors));
}

TEST_CASE("no_sync accumulates locally; the next step reduces the sum") {
  std::vector<std::vector<double>> got(kRanks);
  std::vector<uint64_t> seq_after_no_sync(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(9);
    DataParallel dp(model, g);
    {
      auto guard = dp.no_sync();
      sum(dp(batch_x(2, g.rank()))).backward();
      CHECK_THROWS_WITH_AS(dp.finish_step(), doctest::Contains("inside no_sync"),
                           std::invalid_argument);
    }
    seq_after_no_sync[g.rank()] = g.sequence();
    sum(dp(batch_x(2, 10 + g.rank()))).backward();
    dp.finish_step();
    got[g.rank()] = model->body->find("weight").grad().to_vector<double>();
  });
  REQUIRE(all_ok(errors));
  // Reference: the average over ranks of each rank's two micro-batches.
  auto ref = std::make_shared<TwoHeads>(9);
  for (int r = 0; r < kRanks; ++r) {
    sum(ref->forward(batch_x(2, r))).backward();
    sum(ref->forward(batch_x(2, 10 + r))).backward();
  }
  const auto want = (ref->body->find("weight").grad() / double(kRanks)).to_vector<double>();
  for (std::size_t i = 0; i < want.size(); ++i)
    CHECK(got[0][i] == doctest::Approx(want[i]).epsilon(1e-12));
  CHECK(got[1] == got[0]);
}

TEST_CASE("a second backward without finish_step is an error naming the parameter") {
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(3);
    DataParallel dp(model, g);
    sum(dp(batch_x(1, 0))).backward();
    CHECK_THROWS_WITH(sum(dp(batch_x(1, 0))).backward(),
                      doctest::Contains("received a second gradient"));
  });
  CHECK(all_ok(errors));
}

TEST_CASE("buffers follow rank 0, ignored tensors stay local, step hooks run once per step") {
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(20 + g.rank());
    DataParallel dp(model, g, {.ignore = {"a.bias"}});
    // a.bias was not broadcast: each rank keeps its own init.
    const auto mine = TwoHeads(20 + g.rank()).a->find("bias").to_vector<double>();
    CHECK(model->a->find("bias").to_vector<double>() == mine);
    int calls = 0;
    dp.add_step_hook([&](ProcessGroup& pg) {
      ++calls;
      Tensor c = full({1}, 1.0);
      pg.all_reduce(c);  // hooks may use collectives: same point on every rank
      CHECK(c.item() == kRanks);
    });
    fill_(model->count, 10.0 + g.rank());
    sum(dp(batch_x(2, g.rank()))).backward();
    dp.finish_step();
    CHECK(calls == 1);
    CHECK(model->count.item() == 10.0);  // rank 0's buffer everywhere
    // The ignored parameter's gradient is this rank's own (not averaged).
    CHECK(model->a->find("bias").grad().to_vector<double>() == std::vector<double>{2.0, 2.0});
  });
  CHECK(all_ok(errors));
}

TEST_CASE("a world of one: DataParallel runs unchanged and gradients are the local ones") {
  auto g = ProcessGroup::single();
  auto model = std::make_shared<TwoHeads>(4);
  auto ref = std::make_shared<TwoHeads>(4);
  DataParallel dp(model, *g, {.bucket_bytes = 64});
  sum(dp(batch_x(3, 0))).backward();
  dp.finish_step();
  sum(ref->forward(batch_x(3, 0))).backward();
  CHECK(model->body->find("weight").grad().to_vector<double>() ==
        ref->body->find("weight").grad().to_vector<double>());
}

namespace {

// Every parameter's gradient (empty where it has none), on the host.
std::vector<std::vector<double>> grads_of(Module& m) {
  std::vector<std::vector<double>> out;
  for (auto& p : m.parameters())
    out.push_back(p.grad().defined() ? p.grad().to(Device::cpu()).to_vector<double>()
                                     : std::vector<double>{});
  return out;
}

// Parameter i of `m` belongs to rank i mod n, except the first (body.weight),
// which every rank keeps.
std::function<int(const Tensor&)> owners_mod(Module& m, int n) {
  std::vector<Tensor> ps = m.parameters();
  return [ps, n](const Tensor& p) {
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (ps[i].is_same(p)) return i == 0 ? -1 : int(i) % n;
    return -1;
  };
}

}  // namespace

TEST_CASE("gradients reduced into their owners: each rank keeps its share, the average's values") {
  for (int n : {2, 3})
    for (Device dev : {Device::cpu(), Device::sim(0)}) {
      CAPTURE(n);
      CAPTURE(dev.str());
      auto errors = run_ranks(n, [&](ProcessGroup& g) {
        // Two replicas on the same ranks: one all-reduces, one reduces into owners.
        auto plain = std::make_shared<TwoHeads>(31);
        auto owned = std::make_shared<TwoHeads>(31);
        plain->to(dev);
        owned->to(dev);
        DataParallel dp_plain(plain, g, {.bucket_bytes = 64});
        DataParallel dp_owned(owned, g, {.bucket_bytes = 64});
        const auto owner = owners_mod(*owned, n);
        dp_owned.reduce_gradients_to_owners(owner);
        // Buckets split where the owner changes, and say whose they are.
        std::set<int> bucket_owners;
        for (std::size_t b = 0; b < dp_owned.num_buckets(); ++b)
          bucket_owners.insert(dp_owned.bucket_owner(b));
        CHECK(bucket_owners.size() == std::size_t(n + 1));
        for (std::size_t b = 0; b < dp_plain.num_buckets(); ++b)
          CHECK(dp_plain.bucket_owner(b) == -1);
        const auto step = [&](int s) {
          // Step 1 accumulates two micro-batches; step 2 leaves head b unused everywhere.
          for (auto* m : {plain.get(), owned.get()}) m->use_b = s != 2;
          for (auto* dp : {&dp_plain, &dp_owned}) {
            if (s == 1) {
              auto guard = dp->no_sync();
              sum(dp->forward(batch_x(2, 50 + g.rank()).to(dev))).backward();
            }
            sum(dp->forward(batch_x(3, s + 10 * g.rank()).to(dev))).backward();
            dp->finish_step();
          }
          const auto want = grads_of(*plain), got = grads_of(*owned);
          const auto params = owned->parameters();
          for (std::size_t i = 0; i < params.size(); ++i) {
            CAPTURE(i);
            const int o = owner(params[i]);
            if (o >= 0 && o != g.rank()) {
              CHECK(got[i].empty());  // its owner has it
            } else if (n == 2) {
              CHECK(got[i] == want[i]);  // a sum of two is the same either way
            } else {
              REQUIRE(got[i].size() == want[i].size());
              for (std::size_t j = 0; j < want[i].size(); ++j)
                CHECK(got[i][j] == doctest::Approx(want[i][j]).epsilon(1e-14));
            }
            if (s == 2 && i >= 4) CHECK(got[i].empty());  // b.weight, b.bias: unused everywhere
          }
          plain->zero_grad();
          owned->zero_grad();
        };
        for (int s = 0; s < 3; ++s) step(s);
      });
      CHECK(all_ok(errors));
    }
}

TEST_CASE("reduce_gradients_to_owners refuses an owner outside the world and a step under way") {
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<TwoHeads>(3);
    DataParallel dp(model, g, {.bucket_bytes = 64});
    CHECK_THROWS_WITH_AS(
        dp.reduce_gradients_to_owners([](const Tensor&) { return 2; }),
        doctest::Contains("owner of parameter 'b.bias' is 2, outside a world of 2"),
        std::invalid_argument);
    sum(dp(batch_x(1, 0))).backward();
    CHECK_THROWS_WITH_AS(dp.reduce_gradients_to_owners([](const Tensor&) { return 0; }),
                         doctest::Contains("during a step"), std::invalid_argument);
    dp.finish_step();
    dp.reduce_gradients_to_owners([](const Tensor&) { return 0; });
    CHECK(dp.num_buckets() == 6u);
  });
  CHECK(all_ok(errors));
}

TEST_CASE(
    "OptimizerShards over DataParallel: clipped over every rank's share, AdamW as unsharded") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    std::vector<std::vector<std::vector<double>>> want(n), got(n);
    std::vector<std::vector<double>> want_norms(n), got_norms(n);
    auto errors = run_ranks(n, [&](ProcessGroup& g) {
      auto run = [&](bool shard, std::vector<double>& norms) {
        auto model = std::make_shared<TwoHeads>(41);
        DataParallel dp(model, g, {.bucket_bytes = 64});
        const std::vector<Tensor> params = model->parameters();
        AdamW opt(params, AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
        std::unique_ptr<OptimizerShards> shards;
        if (shard) {
          shards = std::make_unique<OptimizerShards>(g, params);
          shards->reduce_gradients_to_owners(dp);
        }
        for (int s = 0; s < 3; ++s) {
          model->use_b = s != 1;  // a step where b has no gradient anywhere
          sum(dp(batch_x(3, s + 10 * g.rank()))).backward();
          dp.finish_step();
          // A small limit, so that every step clips.
          norms.push_back(shard ? shards->clip_grad_norm_(0.05) : clip_grad_norm_(params, 0.05));
          opt.step();
          if (shard) shards->broadcast_updates();
          opt.zero_grad();
        }
        return values(*model);
      };
      want[g.rank()] = run(false, want_norms[g.rank()]);
      got[g.rank()] = run(true, got_norms[g.rank()]);
    });
    REQUIRE(all_ok(errors));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      if (n == 2) {
        CHECK(got_norms[r] == want_norms[r]);  // the same total, bit for bit
        CHECK(got[r] == want[r]);
      } else {
        CHECK(got[r] == got[0]);  // every rank has the owners' updates
        for (std::size_t k = 0; k < 3; ++k)
          CHECK(got_norms[r][k] == doctest::Approx(want_norms[r][k]).epsilon(1e-13));
        check_close(got[r], want[r]);
      }
    }
  }
}
