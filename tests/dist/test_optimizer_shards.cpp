// OptimizerShards: AdamW over parameters split across 2 and 3 ranks gives
// one process's parameters bit for bit, each rank keeps only its share of
// the state, and the gathered state_dict is the unsharded optimizer's (keys
// and values), which a sharded run of another size loads and continues.
#include <doctest/doctest.h>

#include <map>
#include <vector>

#include "dist/optimizer_shards.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

// Parameters of uneven sizes (one larger than all others together), f32.
std::vector<Tensor> make_params() {
  Generator gen(7);
  std::vector<Tensor> ps;
  for (const Shape& s : std::vector<Shape>{{3, 4}, {5}, {40, 3}, {2, 2}, {7}, {1}}) {
    Tensor p = randn(s, gen);
    p.requires_grad_(true);
    ps.push_back(p);
  }
  return ps;
}

// The gradient of parameter i at step k: the same on every rank (as after
// DataParallel's average).
Tensor grad_at(const Tensor& p, std::size_t i, int k) {
  Generator gen(100 + 10 * k + i);
  return randn(p.shape(), gen);
}

AdamW make_adamw(const std::vector<Tensor>& ps) {
  return AdamW(ps, AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
}

// Runs steps [from, to) of AdamW on `ps` with `opt`, sharded when `shards`.
void run_steps(std::vector<Tensor>& ps, AdamW& opt, OptimizerShards* shards, int from, int to) {
  for (int k = from; k < to; ++k) {
    opt.zero_grad();
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i].set_grad(grad_at(ps[i], i, k));
    if (shards) shards->drop_unowned_grads();
    opt.step();
    if (shards) shards->broadcast_updates();
  }
}

std::vector<std::vector<float>> values(const std::vector<Tensor>& ps) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : ps) out.push_back(p.to_vector<float>());
  return out;
}

std::map<std::string, std::vector<double>> as_map(const StateDict& sd) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [k, v] : sd) out[k] = v.to(Device::cpu()).to_vector<double>();
  return out;
}

}  // namespace

TEST_CASE("OptimizerShards: sharded AdamW equals one process's, with 1/N of the state") {
  // One process: 4 steps, and its state after 2.
  std::vector<Tensor> ref = make_params();
  AdamW ref_opt = make_adamw(ref);
  run_steps(ref, ref_opt, nullptr, 0, 2);
  const auto ref_state_at_2 = as_map(ref_opt.state_dict());
  run_steps(ref, ref_opt, nullptr, 2, 4);
  const auto want = values(ref);

  for (int n : {2, 3}) {
    CAPTURE(n);
    std::vector<StateDict> gathered(n);
    std::vector<std::vector<std::vector<float>>> got(n);
    std::vector<int64_t> owned(n), state_entries(n);
    REQUIRE(all_ok(run_ranks(n, [&](ProcessGroup& g) {
      std::vector<Tensor> ps = make_params();
      AdamW opt = make_adamw(ps);
      OptimizerShards shards(g, ps);
      run_steps(ps, opt, &shards, 0, 2);
      owned[g.rank()] = shards.owned_elements();
      state_entries[g.rank()] = static_cast<int64_t>(opt.state_dict().size());
      gathered[g.rank()] = shards.gather_state(opt.state_dict());
      run_steps(ps, opt, &shards, 2, 4);
      got[g.rank()] = values(ps);
    })));
    int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(got[r] == want);                            // bit for bit, every rank
      CHECK(as_map(gathered[r]) == ref_state_at_2);     // the whole state, every rank
      CHECK(owned[r] < make_params()[2].numel() + 13);  // a share, not the whole
      // Only the owned parameters' state: fewer entries than one process's.
      CHECK(state_entries[r] < static_cast<int64_t>(ref_state_at_2.size()));
      total += owned[r];
    }
    CHECK(total == 12 + 5 + 120 + 4 + 7 + 1);
  }
}

TEST_CASE("OptimizerShards: a whole state_dict resumes on another number of ranks") {
  std::vector<Tensor> ref = make_params();
  AdamW ref_opt = make_adamw(ref);
  run_steps(ref, ref_opt, nullptr, 0, 2);
  StateDict whole;  // detached copies: the live state moves on
  for (const auto& [k, v] : ref_opt.state_dict()) whole.emplace_back(k, v.clone());
  const std::vector<std::vector<float>> at_2 = values(ref);
  run_steps(ref, ref_opt, nullptr, 2, 5);
  const auto want = values(ref);

  std::vector<std::vector<std::vector<float>>> got(3);
  REQUIRE(all_ok(run_ranks(3, [&](ProcessGroup& g) {
    std::vector<Tensor> ps = make_params();
    {
      NoGradGuard no_grad;
      for (std::size_t i = 0; i < ps.size(); ++i) copy_(ps[i], from_vector(at_2[i], ps[i].shape()));
    }
    AdamW opt = make_adamw(ps);
    OptimizerShards shards(g, ps);
    const StateDict mine = shards.owned_state(whole);
    CHECK(mine.size() < whole.size());
    opt.load_state_dict(mine);
    run_steps(ps, opt, &shards, 2, 5);
    got[g.rank()] = values(ps);
  })));
  for (int r = 0; r < 3; ++r) CHECK(got[r] == want);
}

TEST_CASE("OptimizerShards: two parameter groups (one undecayed) shard and gather as one") {
  // Parameters 0, 2 and 4 decayed, 1, 3 and 5 not: a group's parameters
  // are contiguous in the optimizer's order, the shards' runs cross groups.
  const auto grouped = [](const std::vector<Tensor>& ps) {
    ParamGroup decayed{{ps[0], ps[2], ps[4]}}, undecayed{{ps[1], ps[3], ps[5]}};
    undecayed.weight_decay = 0.0;
    return std::vector<ParamGroup>{decayed, undecayed};
  };
  const auto in_order = [](const std::vector<Tensor>& ps) {
    return std::vector<Tensor>{ps[0], ps[2], ps[4], ps[1], ps[3], ps[5]};
  };
  std::vector<Tensor> ref = make_params();
  AdamW ref_opt(grouped(ref), AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
  run_steps(ref, ref_opt, nullptr, 0, 2);
  StateDict whole;
  for (const auto& [k, v] : ref_opt.state_dict()) whole.emplace_back(k, v.clone());
  const auto ref_state_at_2 = as_map(whole);
  const std::vector<std::vector<float>> at_2 = values(ref);
  run_steps(ref, ref_opt, nullptr, 2, 4);
  const auto want = values(ref);
  CHECK(ref_state_at_2.count("state.1.2.exp_avg") == 1);

  std::vector<StateDict> gathered(3);
  std::vector<std::vector<std::vector<float>>> got(3), resumed(3);
  REQUIRE(all_ok(run_ranks(3, [&](ProcessGroup& g) {
    std::vector<Tensor> ps = make_params();
    AdamW opt(grouped(ps), AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
    OptimizerShards shards(g, in_order(ps), {3, 3});
    run_steps(ps, opt, &shards, 0, 2);
    gathered[g.rank()] = shards.gather_state(opt.state_dict());
    run_steps(ps, opt, &shards, 2, 4);
    got[g.rank()] = values(ps);
    // The whole state at step 2 cut to this rank's share: the same 2 steps.
    std::vector<Tensor> again = make_params();
    {
      NoGradGuard no_grad;
      for (std::size_t i = 0; i < again.size(); ++i)
        copy_(again[i], from_vector(at_2[i], again[i].shape()));
    }
    AdamW opt2(grouped(again), AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
    OptimizerShards shards2(g, in_order(again), {3, 3});
    opt2.load_state_dict(shards2.owned_state(whole));
    run_steps(again, opt2, &shards2, 2, 4);
    resumed[g.rank()] = values(again);
  })));
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(got[r] == want);
    CHECK(resumed[r] == want);
    CHECK(as_map(gathered[r]) == ref_state_at_2);
  }
  // Groups that do not hold the parameters given are refused.
  REQUIRE(all_ok(run_ranks(1, [&](ProcessGroup& g) {
    CHECK_THROWS_WITH_AS(OptimizerShards(g, make_params(), {3, 2}),
                         doctest::Contains("the groups hold 5 parameters, not 6"),
                         std::invalid_argument);
    OptimizerShards one(g, make_params());
    CHECK_THROWS_WITH_AS(one.owned_state({{"state.1.0.step", Tensor()}}),
                         doctest::Contains("names no parameter of these 1 group(s)"),
                         std::invalid_argument);
  })));
}
