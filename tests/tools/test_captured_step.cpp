// CapturedStep (tools/quanta/train/captured_step.h) on sim: the step and its
// optimizer replay the eager steps bit for bit; an `after` that draws on the
// host runs after each replay, one that does not joins the graph; batches
// whose shapes keep changing stop the capturing.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <vector>

#include "quanta.h"
#include "train/captured_step.h"

using namespace quanta;

namespace {

const Device kSim = Device::sim(0);

// A small regression step on sim, run through CapturedStep or eagerly.
struct Step {
  std::shared_ptr<Sequential> model;
  std::unique_ptr<Adam> opt;
  Tensor counter;  // what `after` updates on the device
  int after_calls = 0;

  Step() {
    Generator gen(3);
    model =
        std::make_shared<Sequential>(std::make_shared<Linear>(4, 8, gen), std::make_shared<Tanh>(),
                                     std::make_shared<Linear>(8, 1, gen));
    model->to(kSim);
    opt = std::make_unique<Adam>(model->parameters(), AdamOptions{.lr = 1e-2});
    counter = ones({3}, {.device = kSim});
  }
  Tensor body(const std::vector<Tensor>& in) {
    Tensor loss = mse_loss((*model)(in.at(0)), in.at(1));
    loss.backward();
    return loss.detach();
  }
  // `host_draw`: draws a number on the host, as dead-code replacement
  // once did, so a replay could not make it.
  std::function<void()> after(bool host_draw, Generator& host) {
    return [this, host_draw, &host] {
      ++after_calls;
      NoGradGuard no_grad;
      if (host_draw) (void)rand({1}, host);
      mul_(counter, 0.5);
    };
  }
};

// Batch s: rows(s) rows of 4 features and their targets, on the host.
std::vector<Tensor> batch(int s, int64_t rows) {
  Generator g = Generator::named(8, "batch").fork(std::to_string(s));
  const Tensor x = rand({rows, 4}, g);
  return {x, sum(x, {1}, true) * 0.5};
}

std::vector<std::vector<float>> run(bool captured, bool host_draw,
                                    const std::function<int64_t(int)>& rows, int steps,
                                    train::CapturedStep* out = nullptr,
                                    int* after_calls = nullptr) {
  Step st;
  Generator host(1);
  train::CapturedStep cs(kSim, 2);
  std::vector<std::vector<float>> seen;
  const auto after = st.after(host_draw, host);
  for (int s = 0; s < steps; ++s) {
    const std::vector<Tensor> in = batch(s, rows(s));
    Tensor loss;
    if (captured) {
      loss = cs.run(
          in, [&](const std::vector<Tensor>& d) { return st.body(d); }, [&] { st.opt->step(); },
          after, *st.opt);
    } else {
      st.opt->zero_grad();
      loss = st.body({in[0].to(kSim), in[1].to(kSim)});
      st.opt->step();
      after();
    }
    seen.push_back(loss.to(Device::cpu()).to_vector<float>());
  }
  for (const Tensor& p : st.model->parameters())
    seen.push_back(p.to(Device::cpu()).to_vector<float>());
  seen.push_back(st.counter.to(Device::cpu()).to_vector<float>());
  if (out) *out = std::move(cs);
  if (after_calls) *after_calls = st.after_calls;
  return seen;
}

}  // namespace

TEST_CASE("CapturedStep: an update drawing on the host runs after each replay, else in the graph") {
  const auto rows = [](int) { return int64_t(16); };
  for (const bool host_draw : {false, true}) {
    CAPTURE(host_draw);
    train::CapturedStep cs(kSim, 2);
    int calls = 0;
    const auto replayed = run(true, host_draw, rows, 8, &cs, &calls);
    CHECK(replayed == run(false, host_draw, rows, 8));
    CHECK(cs.captures() == 1);
    CHECK_FALSE(cs.draws());
    CHECK(cs.after_in_graph() == !host_draw);
    // Warm-up steps, the capture, then (outside the graph) every replay.
    CHECK(calls == (host_draw ? 8 : 3));
    CHECK(replayed.back() == std::vector<float>(3, 1.0f / 256));  // halved at every step
  }
}

TEST_CASE("CapturedStep: batches whose shapes keep changing stop the capturing") {
  // 16 rows, then a smaller last batch every fourth step, the first right
  // after the capture: graphs that serve several steps keep capturing on.
  train::CapturedStep epochs(kSim, 2);
  const auto epoch_rows = [](int s) { return int64_t(s % 4 == 3 ? 5 : 16); };
  CHECK(run(true, false, epoch_rows, 12, &epochs) == run(false, false, epoch_rows, 12));
  CHECK_FALSE(epochs.stopped());
  CHECK(epochs.captures() > 2);
  // Every step its own length: three graphs serve one step each, then none.
  train::CapturedStep lengths(kSim, 2);
  const auto own_rows = [](int s) { return int64_t(8 + s); };
  CHECK(run(true, false, own_rows, 9, &lengths) == run(false, false, own_rows, 9));
  CHECK(lengths.stopped());
  CHECK(lengths.captures() == 3);
}
