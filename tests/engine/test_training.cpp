// End to end: the engine trains real models, and a checkpoint resumes exactly.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "quanta.h"

using namespace quanta;

namespace {

// A fixed regression task: y = sin(2 x0) + x1 * x2 on 256 points.
struct Task {
  Tensor x, y;
};
Task make_task() {
  Generator gen(7);
  Tensor x = rand({256, 3}, gen) * 2.0 - 1.0;
  Tensor y = sin(select(x, 1, 0) * 2.0) + select(x, 1, 1) * select(x, 1, 2);
  return {x, y.unsqueeze(1)};
}

std::shared_ptr<Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<Sequential>(
      std::make_shared<Linear>(3, 32, gen), std::make_shared<Tanh>(),
      std::make_shared<Linear>(32, 32, gen), std::make_shared<Tanh>(),
      std::make_shared<Linear>(32, 1, gen));
}

double train_step(Module& model, Optimizer& opt, const Task& t) {
  opt.zero_grad();
  Tensor loss = mse_loss(model(t.x), t.y);
  loss.backward();
  opt.step();
  return loss.item();
}

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string("quanta_test_") + name + "_" + std::to_string(::getpid()) + ".safetensors"))
      .string();
}

}  // namespace

TEST_CASE("an MLP learns a fixed synthetic regression to MSE < 0.01") {
  Task t = make_task();
  auto model = make_mlp(1);
  Adam opt(model->parameters(), {.lr = 1e-2});
  double first = 0, last = 0;
  for (int step = 0; step < 400; ++step) {
    last = train_step(*model, opt, t);
    if (step == 0) first = last;
  }
  MESSAGE("MLP mse: first step " << first << ", after 400 steps " << last);
  CHECK(first > 0.1);
  CHECK(last < 0.01);
}

TEST_CASE("a conv autoencoder trains: loss falls over a few SGD steps") {
  Generator gen(3);
  auto model = std::make_shared<Sequential>(
      std::make_shared<Conv2d>(1, 8, std::array<int64_t, 2>{3, 3}, gen,
                               Conv2dOptions{.stride = {2, 2}, .padding = {1, 1}}),
      std::make_shared<ReLU>(),
      std::make_shared<ConvTranspose2d>(
          8, 1, std::array<int64_t, 2>{3, 3}, gen,
          Conv2dOptions{.stride = {2, 2}, .padding = {1, 1}, .output_padding = {1, 1}}));
  Tensor images = rand({4, 1, 8, 8}, gen);
  SGD opt(model->parameters(), {.lr = 0.5, .momentum = 0.9});
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    Tensor recon = (*model)(images);
    REQUIRE(recon.shape() == images.shape());
    Tensor loss = mse_loss(recon, images);
    loss.backward();
    opt.step();
    last = loss.item();
    if (step == 0) first = last;
  }
  MESSAGE("conv autoencoder mse: " << first << " -> " << last);
  CHECK(last < 0.5 * first);
}

TEST_CASE("state_dict through safetensors resumes to the identical next loss") {
  Task t = make_task();
  auto model = make_mlp(2);
  Adam opt(model->parameters(), {.lr = 5e-3});
  for (int i = 0; i < 5; ++i) train_step(*model, opt, t);

  const std::string path = temp_path("resume");
  io::TensorMap all;
  for (auto& [k, v] : model->state_dict()) all.emplace_back("model." + k, v);
  for (auto& [k, v] : opt.state_dict()) all.emplace_back("optim." + k, v);
  io::save_safetensors(path, all, {{"step", "5"}});

  const double uninterrupted = train_step(*model, opt, t);
  const double after = train_step(*model, opt, t);

  // A fresh process-like restart: new modules with other initial values.
  auto restored = make_mlp(99);
  Adam opt2(restored->parameters(), {.lr = 5e-3});
  io::SafetensorsFile f = io::load_safetensors(path);
  CHECK(f.metadata.at("step") == "5");
  StateDict model_sd, optim_sd;
  for (auto& [k, v] : f.tensors) {
    if (k.rfind("model.", 0) == 0) model_sd.emplace_back(k.substr(6), v);
    if (k.rfind("optim.", 0) == 0) optim_sd.emplace_back(k.substr(6), v);
  }
  restored->load_state_dict(model_sd);
  opt2.load_state_dict(optim_sd);
  const double resumed = train_step(*restored, opt2, t);
  const double resumed_after = train_step(*restored, opt2, t);
  CHECK(resumed == uninterrupted);  // bitwise: same values, same order of operations
  CHECK(resumed_after == after);
  std::remove(path.c_str());
}
