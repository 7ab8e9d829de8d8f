// DeviceGraph on sim: recorded work replays with the same bits as running it
// again, the graph keeps its memory, and what a capture cannot hold (reads
// and writes of host memory, a wait, a capture on the CPU) is refused by
// name. The replay cases run on cuda:0 too where a GPU is visible.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "quanta.h"
#include "support/errors.h"
#include "support/gpu.h"

using namespace quanta;
using quanta::testing::message_of;

namespace {

const Device kSim = Device::sim(0);

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::shared_ptr<Sequential> make_mlp(Device device) {
  Generator gen(11);
  auto m =
      std::make_shared<Sequential>(std::make_shared<Linear>(3, 16, gen), std::make_shared<Tanh>(),
                                   std::make_shared<Linear>(16, 1, gen));
  m->to(device);
  return m;
}

// Batch `step` of a fixed regression task, on the host.
std::pair<Tensor, Tensor> batch(int step) {
  Generator gen = Generator::named(5, "batch").fork(std::to_string(step));
  Tensor x = rand({32, 3}, gen) * 2.0 - 1.0;
  Tensor y = sin(select(x, 1, 0) * 2.0) + select(x, 1, 1) * select(x, 1, 2);
  return {x, y.unsqueeze(1)};
}

std::vector<std::vector<float>> values_of(Module& m) {
  std::vector<std::vector<float>> v;
  for (const Tensor& p : m.parameters()) v.push_back(p.to(Device::cpu()).to_vector<float>());
  return v;
}

}  // namespace

// Each case on sim, and on cuda:0 where a GPU is visible (there the
// reference is the same ops run eagerly on the GPU).
TEST_CASE("a captured sequence of ops replays on new inputs as running it again") {
  for (const Device device : quanta::testing::test_devices()) {
    CAPTURE(device.str());
    Tensor x = empty({64}, {.device = device});
    Tensor y;
    auto ops = [](const Tensor& in) { return exp(in * 0.5 + 1.0) - sum(in); };
    DeviceGraph g = DeviceGraph::capture(device, [&] { y = ops(x); });
    CHECK(g.device() == device);
    CHECK(g.recorded_work() >= 4);
    CHECK(g.host_changes() == 0);
    for (int i = 0; i < 3; ++i) {
      Generator gen(static_cast<uint64_t>(i));
      const Tensor input = rand({64}, gen);
      copy_(x, input);
      g.replay();
      const Tensor expected = ops(input.to(device));
      CHECK(y.to(Device::cpu()).to_vector<float>() ==
            expected.to(Device::cpu()).to_vector<float>());
    }
  }
}

TEST_CASE("a captured training step (forward, backward, SGD) equals the eager steps bit for bit") {
  for (const Device device : quanta::testing::test_devices()) {
    CAPTURE(device.str());
    // Eager: zero_grad, forward, backward, step, at every step.
    auto eager = make_mlp(device);
    SGD eager_opt(eager->parameters(), {.lr = 0.05, .momentum = 0.9});
    std::vector<float> eager_losses;
    for (int s = 0; s < 6; ++s) {
      const auto [x, y] = batch(s);
      eager_opt.zero_grad();
      Tensor loss = mse_loss((*eager)(x.to(device)), y.to(device));
      loss.backward();
      eager_opt.step();
      eager_losses.push_back(loss.to(Device::cpu()).to_vector<float>()[0]);
    }

    // Captured: one eager step (the momentum buffers exist after it, so the
    // step's kernels are the same from then on), then the step recorded
    // with its inputs in place and replayed. The gradients are assigned by
    // the captured backward (none before it), so a replay rewrites them.
    auto model = make_mlp(device);
    SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
    Tensor x = empty({32, 3}, {.device = device}), y = empty({32, 1}, {.device = device});
    std::vector<float> losses;
    auto stage = [&](int s) {
      const auto [bx, by] = batch(s);
      copy_(x, bx);
      copy_(y, by);
    };
    Tensor loss;
    auto step = [&] {
      loss = mse_loss((*model)(x), y);
      loss.backward();
      opt.step();
    };
    stage(0);
    opt.zero_grad();
    step();
    losses.push_back(loss.to(Device::cpu()).to_vector<float>()[0]);
    opt.zero_grad();
    DeviceGraph graph = DeviceGraph::capture(device, step);
    for (int s = 1; s < 6; ++s) {
      stage(s);
      graph.replay();
      losses.push_back(loss.to(Device::cpu()).to_vector<float>()[0]);
    }
    CHECK(losses == eager_losses);
    CHECK(values_of(*model) == values_of(*eager));
  }
}

// The state an optimizer saves, on the host: step counts, moments, lr.
std::vector<std::vector<double>> state_of(const Optimizer& opt) {
  std::vector<std::vector<double>> v;
  for (const auto& [name, t] : opt.state_dict())
    v.push_back(t.to(Device::cpu()).to(DType::f64).to_vector<double>());
  return v;
}

TEST_CASE("the optimizer inside the graph: lr, step counts and clipping change per replay") {
  // The whole step captured: forward, backward, clipping and the optimizer,
  // whose lr (a schedule's) and Adam's bias corrections change every step:
  // each replay reads them from device memory it rewrites first.
  struct Case {
    const char* name;
    std::function<std::unique_ptr<Optimizer>(const std::vector<Tensor>&)> make;
  };
  const std::vector<Case> cases = {
      {"Adam", [](const auto& p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 1e-2}); }},
      {"AdamW amsgrad",
       [](const auto& p) {
         return std::make_unique<AdamW>(p, AdamWOptions{.lr = 1e-2, .amsgrad = true});
       }},
      {"Adam L2",
       [](const auto& p) {
         return std::make_unique<Adam>(p, AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
       }},
      {"SGD nesterov",
       [](const auto& p) {
         return std::make_unique<SGD>(
             p, SGDOptions{.lr = 0.05, .momentum = 0.9, .nesterov = true, .weight_decay = 1e-3});
       }},
  };
  const auto lr_at = [](int s) { return 1e-2 * (1.0 + 0.5 * std::sin(s)); };
  for (const Device device : quanta::testing::test_devices())
    for (const Case& c : cases) {
      CAPTURE(device.str());
      CAPTURE(c.name);
      auto eager = make_mlp(device);
      auto eager_opt = c.make(eager->parameters());
      std::vector<float> eager_norms;
      for (int s = 0; s < 6; ++s) {
        const auto [x, y] = batch(s);
        eager_opt->zero_grad();
        mse_loss((*eager)(x.to(device)), y.to(device)).backward();
        eager_norms.push_back(static_cast<float>(clip_grad_norm_(eager->parameters(), 0.5)));
        eager_opt->set_lr(lr_at(s));
        eager_opt->step();
      }

      auto model = make_mlp(device);
      auto opt = c.make(model->parameters());
      Tensor x = empty({32, 3}, {.device = device}), y = empty({32, 1}, {.device = device});
      Tensor norm;
      auto step = [&] {
        mse_loss((*model)(x), y).backward();
        norm = clip_grad_norm_no_sync_(model->parameters(), 0.5);
        opt->step();
      };
      std::vector<float> norms;
      auto stage = [&](int s) {
        const auto [bx, by] = batch(s);
        copy_(x, bx);
        copy_(y, by);
        opt->set_lr(lr_at(s));
      };
      stage(0);
      opt->zero_grad();
      step();  // the state exists after one step
      norms.push_back(static_cast<float>(norm.item()));
      opt->zero_grad();
      stage(1);
      DeviceGraph graph = DeviceGraph::capture(device, step);
      CHECK(graph.host_changes() == 1);  // the step counts
      for (int s = 1; s < 6; ++s) {
        if (s > 1) stage(s);
        graph.replay();
        norms.push_back(static_cast<float>(norm.item()));
      }
      CHECK(norms == eager_norms);
      CHECK(*std::max_element(norms.begin(), norms.end()) > 0.5f);  // some step clipped
      CHECK(values_of(*model) == values_of(*eager));
      CHECK(state_of(*opt) == state_of(*eager_opt));
    }
}

TEST_CASE("an optimizer step a replay could not repeat exactly is refused inside a capture") {
  auto model = make_mlp(kSim);
  Tensor x = zeros({4, 3}, {.device = kSim}), y = zeros({4, 1}, {.device = kSim});
  Adam fresh(model->parameters(), {.lr = 1e-2});
  mse_loss((*model)(x), y).backward();
  // Its first step makes the moments: a replay would zero them again.
  const std::string first = message_of([&] { DeviceGraph::capture(kSim, [&] { fresh.step(); }); });
  CHECK(contains(first, "[Adam] parameter 0 of group 0 has no exp_avg yet"));
  CHECK(contains(first, "run a step before capturing"));

  // A bf16 parameter's step is a chain of ops whose lr is an argument.
  Tensor w = ones({8}, {.dtype = DType::bf16, .device = kSim}).requires_grad_();
  SGD sgd({w}, {.lr = 0.1});
  sum(w * 2.0).backward();
  const std::string bf16 = message_of([&] { DeviceGraph::capture(kSim, [&] { sgd.step(); }); });
  CHECK(contains(bf16, "[SGD] parameter 0 of group 0 (bf16) cannot be stepped in a captured step"));

  // The value clip_grad_norm_ returns is a read of the device.
  mse_loss((*model)(x), y).backward();
  const std::string read = message_of(
      [&] { DeviceGraph::capture(kSim, [&] { clip_grad_norm_(model->parameters(), 1.0); }); });
  CHECK(contains(read, "captured step"));
}

TEST_CASE("a graph keeps the memory its capture allocated until it is destroyed") {
  reset_device_stats(kSim);
  const int64_t before = device_stats(kSim).allocated_bytes;
  Tensor x = ones({1000}, {.device = kSim});
  Tensor kept;
  {
    DeviceGraph g = DeviceGraph::capture(kSim, [&] {
      const Tensor scratch = x * 2.0;  // freed inside the capture, written by each replay
      kept = scratch + 1.0;
    });
    const int64_t during = device_stats(kSim).allocated_bytes;
    CHECK(during >= before + 3 * 4000);  // x, scratch (kept by the graph), kept
    kept = Tensor();                     // let go by the host, still written by replays
    CHECK(device_stats(kSim).allocated_bytes == during);
    g.replay();
    g.replay();
  }
  // Destroyed: what nobody holds is returned once the replays are done.
  synchronize(kSim);
  CHECK(device_stats(kSim).allocated_bytes == before + 4000);
}

TEST_CASE("a tensor made while capturing outlives its graph") {
  Tensor x = full({8}, 3.0, {.device = kSim});
  Tensor out;
  {
    DeviceGraph g = DeviceGraph::capture(kSim, [&] { out = x * x; });
    g.replay();
  }
  CHECK(out.to(Device::cpu()).to_vector<float>() == std::vector<float>(8, 9.0f));
}

TEST_CASE("on_replay: each replay after the first makes the step's host changes again") {
  int64_t counter = 0;
  Tensor x = ones({4}, {.device = kSim});
  on_replay([&] { counter += 100; });  // outside a capture: nothing
  DeviceGraph g = DeviceGraph::capture(kSim, [&] {
    mul_(x, 2.0);
    ++counter;
    on_replay([&] { ++counter; });
  });
  CHECK(counter == 1);  // the captured step's host part
  CHECK(g.host_changes() == 1);
  g.replay();  // the captured step's device part
  CHECK(counter == 1);
  g.replay();  // one more step
  g.replay();
  CHECK(counter == 3);
  CHECK(capturing(kSim) == false);
  CHECK(x.to(Device::cpu()).to_vector<float>() == std::vector<float>(4, 8.0f));
}

// A layer's own stream (set_replayable) draws inside a capture: each replay
// draws the numbers the uncaptured step would, dropout's backward drawing
// its forward's mask again.
TEST_CASE("device draws in a captured step: each replay draws that step's numbers") {
  for (const Device device : quanta::testing::test_devices()) {
    CAPTURE(device.str());
    auto run = [&](bool captured) {
      Generator noise = Generator::named(3, "noise"), drop = Generator::named(3, "drop");
      noise.set_replayable();
      drop.set_replayable();
      Tensor w = full({5, 6}, 0.5, {.device = device}).requires_grad_(true);
      Tensor x = empty({6}, {.device = device});
      Tensor noisy, y;
      auto step = [&] {
        noisy = x + rand({6}, noise, {.device = device});
        y = sum(dropout_linear(dropout(noisy, 0.3, true, drop).unsqueeze(0), w, 0.5, true, drop));
        w.zero_grad();
        y.backward();
      };
      std::vector<std::vector<float>> seen;
      std::optional<DeviceGraph> g;
      for (int s = 0; s < 4; ++s) {
        copy_(x, full({6}, double(s)));
        if (!captured) {
          step();
        } else {
          if (!g) g = DeviceGraph::capture(device, step);
          g->replay();
        }
        seen.push_back(noisy.to(Device::cpu()).to_vector<float>());
        seen.push_back(w.grad().to(Device::cpu()).to_vector<float>());
      }
      if (captured) CHECK(g->draws() == 3);  // the noise, and the two dropouts' masks
      return seen;
    };
    const auto eager = run(false), replayed = run(true);
    CHECK(replayed == eager);
    CHECK(eager[0] != eager[2]);  // each step its own noise
  }
}

TEST_CASE("a draw a replay could not make again is refused inside a capture") {
  Generator own(5);  // no layer owns it
  CHECK(contains(message_of([&] {
                   (void)DeviceGraph::capture(kSim,
                                              [&] { (void)rand({4}, own, {.device = kSim}); });
                 }),
                 "[Generator] a random draw inside a captured step from a stream that may not "
                 "outlive the graph"));
  own.set_replayable();
  CHECK(contains(message_of([&] {
                   (void)DeviceGraph::capture(kSim, [&] { (void)rand({4}, own); });  // the host's
                 }),
                 "[Generator] a random draw for the host inside a captured step"));
  Generator copy = own;  // a copy draws only a stream the capture drew already
  CHECK(copy.replay() == Generator::Replay::copy);
  CHECK(contains(message_of([&] {
                   (void)DeviceGraph::capture(kSim,
                                              [&] { (void)rand({4}, copy, {.device = kSim}); });
                 }),
                 "may not outlive the graph"));
}

TEST_CASE("what a capture cannot hold is refused by name") {
  Tensor x = ones({4}, {.device = kSim});
  CHECK(message_of([&] { (void)DeviceGraph::capture(Device::cpu(), [] {}); }) ==
        "[DeviceGraph] cpu cannot record work: the CPU runs ops as they are called");
  // A read of the device: its work has not run.
  CHECK(
      contains(message_of([&] { (void)DeviceGraph::capture(kSim, [&] { (void)sum(x).item(); }); }),
               "[host sync] a copy of 4 bytes from sim:0 to the host inside a captured step on "
               "sim:0"));
  // A copy from the host: a replay would copy the capture's bytes again.
  const std::string upload =
      message_of([&] { (void)DeviceGraph::capture(kSim, [&] { (void)ones({4}).to(kSim); }); });
  CHECK(contains(upload, "[copy] 16 bytes from the host to sim:0 inside a captured step"));
  CHECK(contains(upload, "before each replay"));
  CHECK(message_of([&] { (void)DeviceGraph::capture(kSim, [&] { synchronize(kSim); }); }) ==
        "[synchronize] inside a captured step on sim:0: its work runs at replay; synchronize "
        "after replay()");
  CHECK(message_of([&] {
          (void)DeviceGraph::capture(kSim, [&] { (void)DeviceGraph::capture(kSim, [] {}); });
        }) ==
        "[DeviceGraph] a capture of sim:0 is already open on this thread; captures do not "
        "nest");
  // After each refusal the device runs work again as it is queued.
  CHECK_FALSE(capturing(kSim));
  add_(x, full({4}, 1.0, {.device = kSim}));
  CHECK(x.to(Device::cpu()).to_vector<float>() == std::vector<float>(4, 2.0f));
}

TEST_CASE("a capture on another sim device leaves sim:0's queue alone") {
  const Device other = Device::sim(1);
  Tensor a = ones({4}, {.device = kSim}), b = ones({4}, {.device = other});
  DeviceGraph g = DeviceGraph::capture(other, [&] {
    mul_(a, 2.0);  // sim:0's work runs now
    mul_(b, 2.0);  // sim:1's is recorded
  });
  CHECK(a.to(Device::cpu()).to_vector<float>() == std::vector<float>(4, 2.0f));
  CHECK(b.to(Device::cpu()).to_vector<float>() == std::vector<float>(4, 1.0f));
  g.replay();
  CHECK(b.to(Device::cpu()).to_vector<float>() == std::vector<float>(4, 2.0f));
}
