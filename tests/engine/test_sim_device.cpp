// The sim device: parsing and names, a GPU's rules (no mixing with CPU
// tensors, no direct host access), the CPU's bits, the host-sync counters
// and guards (engine/host_sync.h) that hold on CUDA too, and its streams:
// asynchronous kernels, stream-ordered frees, failures reported at a wait.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/device_backend.h"
#include "engine/sim/sim_stream.h"
#include "quanta.h"
#include "support/errors.h"
#include "support/gpu.h"

using namespace quanta;
using quanta::testing::message_of;

TEST_CASE("sim devices parse, print and differ by index") {
  CHECK(Device::parse("sim") == Device::sim(0));
  CHECK(Device::parse("sim:3") == Device::sim(3));
  CHECK(Device::sim(1).str() == "sim:1");
  CHECK(Device::sim(0) != Device::sim(1));
  CHECK(Device::sim(0) != Device::cuda(0));
  CHECK(Device::sim(0).is_sim());
  CHECK_FALSE(Device::sim(0).is_cpu());
  for (const char* bad : {"sim:", "sim:x", "sim:-1", "sims", "SIM"})
    CHECK(message_of([&] { (void)Device::parse(bad); }).find("'sim' or 'sim:N'") !=
          std::string::npos);
}

TEST_CASE("sim tensors obey a GPU's rules: no mixing, no direct host access") {
  const Device sim = Device::sim(0);
  const Tensor a = ones({3}, {.device = sim}), b = ones({3});
  CHECK(a.device() == sim);
  CHECK(message_of([&] { (void)add(a, b); }) ==
        "[add] operands are on different devices: sim:0 and cpu; move them to one device first");
  CHECK(message_of([&] {
          (void)add(a, ones({3}, {.device = Device::sim(1)}));
        }).find("sim:0 and sim:1") != std::string::npos);
  CHECK(message_of([&] { (void)a.data<float>(); }) ==
        "[data] tensor is on sim:0; copy it to cpu first");
  // Copies in every direction, a CUDA-less sim:1 included.
  const Tensor c = a.to(Device::sim(1)).to(Device::cpu());
  CHECK(c.to_vector<float>() == std::vector<float>{1, 1, 1});
  CHECK_FALSE(device_caps(sim).host_readable);
  CHECK(device_caps(Device::cpu()).host_readable);
}

TEST_CASE("sim gives the CPU's bits (the CPU's kernels on memory of its own)") {
  Generator g(3), h(3);
  const Tensor x = randn({33, 17}, g), w = randn({17, 5}, g);
  const Tensor want = softmax(matmul(x, w), -1);
  const Tensor got = softmax(matmul(x.to(Device::sim()), w.to(Device::sim())), -1);
  REQUIRE(got.device() == Device::sim());
  const Tensor back = got.to(Device::cpu());
  CHECK(std::memcmp(back.raw_data(), want.raw_data(), want.nbytes()) == 0);
  // Random draws made on sim equal the CPU's.
  const Tensor r = randn({1000}, h, {.device = Device::sim()}).to(Device::cpu());
  Generator fresh(3);
  CHECK(r.to_vector<float>() == randn({1000}, fresh).to_vector<float>());
}

TEST_CASE("device_stats counts host syncs, copies and sim memory") {
  const Device sim = Device::sim(2);  // a device no other case touches
  reset_device_stats(sim);
  {
    const Tensor a = zeros({256}, {.device = sim});  // 1 KiB
    DeviceStats s = device_stats(sim);
    CHECK(s.allocations == 1);
    CHECK(s.allocated_bytes == 1024);
    CHECK(s.host_syncs == 0);
    (void)a.to_vector<float>();
    (void)sum(a).item();
    s = device_stats(sim);
    CHECK(s.host_syncs == 2);
    CHECK(s.copies_to_host == 2);
    CHECK(s.bytes_to_host == 1024 + 4);
    const Tensor b = ones({8}).to(sim);
    s = device_stats(sim);
    CHECK(s.copies_from_host == 1);
    CHECK(s.bytes_from_host == 32);
    CHECK(s.host_syncs == 2);  // an upload does not wait for the device
    (void)b.clone();
    CHECK(device_stats(sim).peak_allocated_bytes >= 1024 + 32);
  }
  CHECK(device_stats(sim).allocated_bytes == 0);
  CHECK(device_stats(Device::cpu()).host_syncs == 0);
}

TEST_CASE("HostSyncGuard refuses a host sync, names where, and lets uploads through") {
  const Device sim = Device::sim(0);
  const Tensor a = full({4}, 2.0, {.device = sim});
  {
    HostSyncGuard guard("the steady-state step");
    const Tensor b = ones({4}).to(sim);  // host to device: no sync
    const Tensor c = a * b;              // kernels: no sync
    const std::string m = message_of([&] { (void)sum(c).item(); });
    CHECK(m.find("[host sync]") == 0);
    CHECK(m.find("from sim:0") != std::string::npos);
    CHECK(m.find("inside the steady-state step") != std::string::npos);
    {
      HostSyncGuard inner("the inner scope");
      CHECK(message_of([&] { (void)c.to(Device::cpu()); }).find("inside the inner scope") !=
            std::string::npos);
    }
    CHECK(message_of([&] { (void)c.to_vector<float>(); }).find("inside the steady-state step") !=
          std::string::npos);
    // The callers follow, the op that read the device first.
    const std::string named =
        message_of([&] { (void)nonzero(gt(a, zeros({4}, {.device = sim}))); });
    CHECK(named.find("\n    at quanta::nonzero(") != std::string::npos);
  }
  CHECK(a.to_vector<float>() == std::vector<float>{2, 2, 2, 2});  // allowed again
}

TEST_CASE("a bad index on a device is found there and reported at the next read, naming the op") {
  for (const Device sim : testing::test_devices()) {
    CAPTURE(sim.str());
    const TensorOptions on_sim{.dtype = DType::i64, .device = sim};
    const Tensor x = from_vector<float>({1, 2, 3}, {3}).to(sim);
    const Tensor idx = from_vector<int64_t>({0, 7, 1}, {3}, on_sim);
    Tensor y;
    {
      HostSyncGuard guard("queuing the op");  // the check itself reads nothing
      y = index_select(x, 0, idx);
    }
    const std::string m = message_of([&] { (void)y.to_vector<float>(); });
    CHECK(m.find("[index_select] index 7 is out of bounds for dim 0 with size 3") == 0);
    CHECK(m.find("found on " + sim.str()) != std::string::npos);
    // Reported once; the kernel read row 0 for the bad index, never out of bounds.
    CHECK(y.to_vector<float>() == std::vector<float>{1, 1, 2});

    // The other index ops, each named; the CPU still fails at once, alike.
    const Tensor bad = from_vector<int64_t>({-1}, {1}, on_sim);
    const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> ops = {
        {"gather", [&](const Tensor& i) { return gather(x, 0, i); }},
        {"scatter", [&](const Tensor& i) { return scatter(x, 0, i, 5.0); }},
        {"index_add",
         [&](const Tensor& i) { return index_add(x, 0, i, ones({1}, {.device = sim})); }},
        {"embedding",
         [&](const Tensor& i) {
           return embedding(reshape(x, {3, 1}), i);
         }},
    };
    for (const auto& [name, op] : ops) {
      CAPTURE(name);
      const Tensor out = op(bad);
      const std::string e = message_of([&] { (void)out.to(Device::cpu()); });
      CHECK(e.find("[" + name + "] index -1 is out of bounds") == 0);
      CHECK(message_of([&] { (void)out.to(Device::cpu()); }).empty());  // cleared
    }
    // cross_entropy's targets, checked by the device as well.
    const Tensor loss =
        cross_entropy(ones({1, 3}, {.device = sim}), from_vector<int64_t>({5}, {1}, on_sim));
    CHECK(message_of([&] {
            (void)loss.item();
          }).find("[cross_entropy] index 5 is out of bounds for dim 1 with size 3") == 0);
  }
  CHECK(message_of([] {
          (void)index_select(from_vector<float>({1, 2, 3}, {3}), 0,
                             from_vector<int64_t>({0, 7, 1}, {3}));
        }).find("[index_select] index 7 is out of bounds for dim 0 with size 3") == 0);
}

namespace {
// Holds sim device `index`'s stream until release(): work queued behind it
// waits, as a GPU's kernels wait behind a long one.
class StreamGate {
 public:
  explicit StreamGate(int index) {
    sim::enqueue(index, [f = open_.get_future().share()] { f.wait(); });
  }
  ~StreamGate() { release(); }
  void release() {
    if (!released_) open_.set_value();
    released_ = true;
  }

 private:
  std::promise<void> open_;
  bool released_ = false;
};
}  // namespace

TEST_CASE("sim runs kernels asynchronously: the host goes on, a read waits for the stream") {
  const Device sim = Device::sim();
  const Tensor x = from_vector<float>({1, 2, 3}, {3}).to(sim);
  Tensor y = zeros({3}, {.device = sim});
  synchronize(sim);
  {
    StreamGate gate(sim.index);
    {
      HostSyncGuard guard("queuing behind a busy stream");
      copy_(y, add(x, x));  // queued, not run: the host does not wait for it
    }
    // A host that reads the memory without waiting reads a race: the sum is
    // not there yet (its kernel is held behind the gate).
    float raw[3];
    std::memcpy(raw, y.raw_data(), sizeof raw);  // what a missing wait sees
    CHECK(std::vector<float>(raw, raw + 3) == std::vector<float>{0, 0, 0});
    gate.release();
    // A read waits for everything queued before it.
    CHECK(y.to_vector<float>() == std::vector<float>{2, 4, 6});
  }
  // synchronize waits without moving data: not a host sync.
  reset_device_stats(sim);
  y = mul(y, y);
  synchronize(sim);
  CHECK(device_stats(sim).host_syncs == 0);
  CHECK(y.to_vector<float>() == std::vector<float>{4, 16, 36});
}

TEST_CASE("sim: a host at most 1024 jobs ahead of its stream waits, as a full launch queue does") {
  const Device sim = Device::sim(5);  // a stream of its own
  std::atomic<int> queued{0};
  StreamGate gate(sim.index);  // holds the stream: nothing queued after it runs yet
  std::thread host([&] {
    for (int i = 0; i < 1100; ++i) {
      sim::enqueue(sim.index, [] {});
      ++queued;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // The gate and 1023 more fill the queue; the next enqueue waits for room.
  CHECK(queued.load() <= 1024);
  gate.release();
  host.join();
  CHECK(queued.load() == 1100);
  synchronize(sim);
}

TEST_CASE("sim frees memory in stream order, after the kernels queued before the free") {
  const Device sim = Device::sim();
  Tensor out = zeros({4}, {.device = sim});
  {
    StreamGate gate(sim.index);
    {
      // The inputs die before the kernel that reads them has run: their
      // memory must outlive it (ASan would see a use after free otherwise).
      const Tensor a = from_vector<float>({1, 2, 3, 4}, {4}).to(sim);
      const Tensor b = full({4}, 10.0, {.device = sim});
      copy_(out, add(a, b));
    }
    const DeviceStats held = device_stats(sim);
    gate.release();
    CHECK(held.allocated_bytes >= 16);  // out's bytes at least, counted while queued
  }
  CHECK(out.to_vector<float>() == std::vector<float>{11, 12, 13, 14});
}

TEST_CASE(
    "sim: a failure in queued work is reported at the next wait, and skips the work after it") {
  const Device sim = Device::sim(3);  // a stream of its own
  bool later_ran = false;
  bool free_ran = false;
  sim::enqueue(sim.index, [] { throw std::runtime_error("[a kernel] went wrong"); });
  sim::enqueue(sim.index, [&later_ran] { later_ran = true; });
  sim::enqueue(
      sim.index, [&free_ran] { free_ran = true; }, /*after_failure=*/true);
  CHECK_THROWS_WITH_AS(synchronize(sim), "[a kernel] went wrong", std::runtime_error);
  CHECK_FALSE(later_ran);  // no kernel reads what a failed one left
  CHECK(free_ran);         // frees still run
  // Reported once; the stream serves again.
  synchronize(sim);
  const Tensor t = full({2}, 3.0, {.device = sim});
  CHECK(t.to_vector<float>() == std::vector<float>{3, 3});
}

TEST_CASE("sim: every thread's work queues on the device's one stream, in order") {
  const Device sim = Device::sim();
  Tensor acc = zeros({1}, {.dtype = DType::f64, .device = sim});
  std::vector<std::thread> threads;
  std::mutex order;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        std::lock_guard<std::mutex> lock(order);  // tensors are not thread-safe; the stream is
        acc = add(acc, full({1}, 1.0, {.dtype = DType::f64, .device = sim}));
      }
    });
  for (std::thread& t : threads) t.join();
  CHECK(acc.item() == 200.0);
}

TEST_CASE("sim events: a wait for an event does not wait for the work queued after it") {
  // What a collective's stream does with DataParallel's ready event: it
  // starts when the bucket's copies are done, while backward goes on.
  const Device sim = Device::sim(4);  // a stream of its own
  bool before = false;
  sim::enqueue(sim.index, [&before] { before = true; });
  const sim::Event ready = sim::record_event(sim.index);
  StreamGate gate(sim.index);  // later work, held
  auto waited = std::async(std::launch::async, [&] { sim::wait_event(ready); });
  const bool returned = waited.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  CHECK(returned);  // else it waited for the gate too
  CHECK(before);
  gate.release();
  waited.wait();
  synchronize(sim);
}
