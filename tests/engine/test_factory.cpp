// The shared constants (shared_full, constant_like, constant_tensor): one
// tensor per key on a device, made outside a graph so that a captured step
// holds no fill for them, and refused by every in-place op. The device cases
// run on sim:0 and, where a GPU is visible, cuda:0.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "quanta.h"
#include "support/errors.h"
#include "support/gpu.h"

using namespace quanta;
using quanta::testing::message_of;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

bool same_buffer(const Tensor& a, const Tensor& b) { return a.storage() == b.storage(); }

}  // namespace

TEST_CASE("shared_full: one tensor per device, dtype, shape and value") {
  for (const Device dev : quanta::testing::test_devices()) {
    INFO(dev.str());
    const TensorOptions f32{.dtype = DType::f32, .device = dev};
    const Tensor a = shared_full({}, 2.5, f32);
    CHECK(same_buffer(a, shared_full({}, 2.5, f32)));
    CHECK(a.to(Device::cpu()).item() == 2.5);
    // Every part of the key tells two constants apart.
    CHECK_FALSE(same_buffer(a, shared_full({}, 2.5, {.dtype = DType::f64, .device = dev})));
    CHECK_FALSE(same_buffer(a, shared_full({1}, 2.5, f32)));
    CHECK_FALSE(same_buffer(a, shared_full({}, 2.25, f32)));
    CHECK_FALSE(same_buffer(shared_full({}, 0.0, f32), shared_full({}, -0.0, f32)));
    const Tensor row = shared_full({5}, -1.0, {.dtype = DType::i64, .device = dev});
    CHECK(row.to(Device::cpu()).to_vector<int64_t>() == std::vector<int64_t>(5, -1));
    // A large one is made anew: a caller's big tensor is not pinned for good.
    const Shape big{(int64_t{1} << 16) + 1};
    CHECK_FALSE(same_buffer(shared_full(big, 1.0, f32), shared_full(big, 1.0, f32)));
  }
  // On the CPU a fill is a store, not a launch: a new tensor each call.
  CHECK_FALSE(same_buffer(shared_full({}, 2.5), shared_full({}, 2.5)));
  CHECK(contains(message_of([] { shared_full({}, 1.0, {.requires_grad = true}); }),
                 "[shared_full] a shared constant cannot require grad"));
}

TEST_CASE("shared_arange: arange's values, one tensor per device, dtype and length") {
  for (const Device dev : quanta::testing::test_devices()) {
    INFO(dev.str());
    const TensorOptions i64{.dtype = DType::i64, .device = dev};
    const Tensor a = shared_arange(6, i64);
    CHECK(same_buffer(a, shared_arange(6, i64)));
    CHECK_FALSE(same_buffer(a, shared_arange(7, i64)));
    CHECK(a.to(Device::cpu()).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
    CHECK(shared_arange(0, i64).numel() == 0);
    const Tensor f = shared_arange(3, {.dtype = DType::f32, .device = dev});
    CHECK(f.to(Device::cpu()).to_vector<float>() == std::vector<float>{0, 1, 2});
  }
  CHECK_FALSE(same_buffer(shared_arange(6), shared_arange(6)));  // the CPU: a new one
}

TEST_CASE("constant_like: scalar_like's dtype, shared") {
  const Device dev = Device::sim(0);
  const Tensor i = zeros({3}, {.dtype = DType::i64, .device = dev});
  CHECK(constant_like(i, 2.0).dtype() == DType::i64);
  CHECK(constant_like(i, 0.5).dtype() == DType::f32);  // a fraction beside integers
  CHECK(constant_like(zeros({3}, {.dtype = DType::boolean, .device = dev}), 1.0).dtype() ==
        DType::f32);
  const Tensor x = zeros({3}, {.dtype = DType::bf16, .device = dev});
  CHECK(constant_like(x, 3.0).dtype() == DType::bf16);
  CHECK(same_buffer(constant_like(x, 3.0), constant_like(x, 3.0)));
  CHECK_FALSE(same_buffer(scalar_like(x, 3.0), scalar_like(x, 3.0)));  // scalar_like: a new one
}

TEST_CASE("a shared constant refuses every in-place op, by name") {
  std::vector<Tensor> shared{constant_tensor<float>({1, 2}, {2})};  // kept on the CPU too
  for (const Device dev : quanta::testing::test_devices())
    shared.push_back(shared_full({2}, 4.0, {.device = dev}));
  for (const Tensor& c : shared) {
    INFO(c.device().str());
    const std::vector<float> before = c.to(Device::cpu()).to_vector<float>();
    const Tensor other = ones({2}, {.device = c.device()});
    Generator gen(1);
    const auto refused = [&](const char* op, const std::function<void()>& f) {
      INFO(op);
      CHECK(contains(message_of(f), std::string("[") + op + "] in-place update of a shared "));
    };
    refused("fill_", [&] { fill_(c, 0.0); });
    refused("copy_", [&] { copy_(c, other); });
    refused("add_", [&] { add_(c, other); });
    refused("mul_", [&] { mul_(c, 2.0); });
    refused("div_", [&] { div_(c, other); });
    refused("addcmul_", [&] { addcmul_(c, other, other, 1.0); });
    refused("copy_", [&] { uniform_(c, 0.0, 1.0, gen); });  // a draw is written by copy_
    CHECK(c.to(Device::cpu()).to_vector<float>() == before);
    // Read, it is any tensor; a copy of it is the caller's own.
    const Tensor mine = c.clone();
    add_(mine, other);
    CHECK(mine.to(Device::cpu()).to_vector<float>()[0] == before[0] + 1.0f);
  }
}

TEST_CASE("an op with a double records no fill in a graph once its constant exists") {
  const Device dev = Device::sim(0);
  const Tensor x = ones({8}, {.device = dev});
  Tensor y;
  // Seen before the capture: the graph holds the mul and the add alone.
  y = x * 3.0 + 1.5;
  DeviceGraph warm = DeviceGraph::capture(dev, [&] { y = x * 3.0 + 1.5; });
  CHECK(warm.recorded_work() == 2);
  // A value first met inside a capture is filled there (the graph's memory,
  // written by its replays), and not kept for calls outside the graph: one
  // made there now has its value before the graph ever runs.
  Tensor z;
  DeviceGraph cold = DeviceGraph::capture(dev, [&] { z = x * 7.75; });
  CHECK(cold.recorded_work() == 2);
  CHECK((x * 7.75).to(Device::cpu()).to_vector<float>() == std::vector<float>(8, 7.75f));
  cold.replay();
  CHECK(z.to(Device::cpu()).to_vector<float>() == std::vector<float>(8, 7.75f));
  warm.replay();
  CHECK(y.to(Device::cpu()).to_vector<float>() == std::vector<float>(8, 4.5f));
}

TEST_CASE("a training step's constants are filled once, outside the graph") {
  // On a device no other case touches, the first capture meets every
  // constant of the step (scalars of the forward, the backward formulas'
  // and the loss's) inside the graph; after one step run as it is called,
  // the capture holds none of them.
  const Device dev = Device::sim(4);
  const Tensor w = ones({8}, {.device = dev, .requires_grad = true});
  const auto step = [&] {
    const Tensor loss = mean(square(clamp(w * 0.5, 0.0, 2.0) - 1.0)) * 2.0;
    loss.backward();
  };
  const int64_t cold = DeviceGraph::capture(dev, step).recorded_work();
  step();
  const int64_t warm = DeviceGraph::capture(dev, step).recorded_work();
  INFO("cold " << cold << ", warm " << warm);
  CHECK(warm < cold);
  CHECK(cold - warm >= 5);  // 0.5, 0 and 2 (clamp), 1, 2 and the mean's count among them
}
