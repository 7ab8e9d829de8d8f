// CallProfile (engine/profile/call_profile.h): what it counts, on which
// device's table, what its two timings wait for, and that it changes
// nothing it watches.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/device_backend.h"
#include "engine/kernels/table.h"
#include "engine/profile/timed_table.h"
#include "engine/sim/sim_stream.h"
#include "llm/ops/rms_norm.h"
#include "quant/kernels/table.h"
#include "quant/nf4/nf4_format.h"
#include "quanta.h"

using namespace quanta;

namespace {

// The row of `name` on `device`'s table, or one of 0 calls.
CallProfileRow row(const CallProfile& p, const std::string& name,
                   DeviceType device = DeviceType::cpu) {
  for (const CallProfileRow& r : p.rows())
    if (r.name == name && r.device == device) return r;
  return {name, device, 0, 0};
}

int64_t calls(const CallProfile& p, const std::string& name, DeviceType device = DeviceType::cpu) {
  return row(p, name, device).calls;
}

}  // namespace

TEST_CASE("call profile: each entry's calls on the CPU, made while it runs") {
  NoGradGuard no_grad;
  const Tensor a = full({64}, 2.0), b = full({64}, 3.0);
  const Tensor before = a + b;  // not counted
  CallProfile p;
  CHECK(p.running());
  CHECK(p.timing() == CallTiming::host);
  Tensor c = a + b;
  c = c * b;
  c = exp(c);
  p.stop();
  const Tensor after = a * b;  // not counted either
  CHECK_FALSE(p.running());
  // An elementwise family's calls, by op.
  CHECK(calls(p, "engine.binary:add") == 1);
  CHECK(calls(p, "engine.binary:mul") == 1);
  CHECK(calls(p, "engine.binary") == 0);
  CHECK(calls(p, "engine.unary:exp") == 1);
  CHECK(calls(p, "device.allocate") >= 3);  // each result's memory
  // The rows, the most time first, each with its time; the totals are the
  // outermost calls', here every call.
  const std::vector<CallProfileRow> rows = p.rows();
  REQUIRE_FALSE(rows.empty());
  int64_t sum_calls = 0;
  double sum_seconds = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    CHECK(rows[i].calls > 0);
    CHECK(rows[i].seconds >= 0);
    if (i > 0) CHECK(rows[i - 1].seconds >= rows[i].seconds);
    sum_calls += rows[i].calls;
    sum_seconds += rows[i].seconds;
  }
  CHECK(p.calls() == sum_calls);
  CHECK(p.seconds() == doctest::Approx(sum_seconds).epsilon(1e-6));
  CHECK(p.seconds() > 0);
  // Stopped, it says the same whatever runs later.
  const Tensor more = exp(a);
  CHECK(calls(p, "engine.unary:exp") == 1);
  CHECK(p.calls() == sum_calls);
}

TEST_CASE("call profile: with events, each call on a timeline, as many as the rows count") {
  NoGradGuard no_grad;
  const Tensor a = full({64}, 2.0), b = full({64}, 3.0);
  CallProfile quiet;  // a profile without events records none
  CallProfile p(CallTiming::host, /*events=*/true);
  Tensor c = a + b;
  std::thread other([&] { (void)exp(a); });
  other.join();
  c = exp(c * b);
  p.stop();
  const Tensor after = a * b;  // not recorded
  quiet.stop();
  CHECK(quiet.events().empty());
  const std::vector<CallEvent> events = p.events();
  int64_t calls = 0;
  for (const CallProfileRow& r : p.rows()) calls += r.calls;
  CHECK(int64_t(events.size()) == calls);
  std::map<std::string, int> by_name;
  std::set<int> threads;
  for (const CallEvent& e : events) {
    ++by_name[e.name];
    threads.insert(e.thread);
    CHECK(e.start >= 0);
    CHECK(e.seconds >= 0);
    CHECK(e.device == DeviceType::cpu);
  }
  CHECK(by_name["engine.binary:add"] == 1);
  CHECK(by_name["engine.binary:mul"] == 1);
  CHECK(by_name["engine.unary:exp"] == 2);
  CHECK(threads.size() == 2);  // this thread's calls and the other's
}

TEST_CASE("call profile: resumed, it adds each span it ran and leaves out the gaps") {
  NoGradGuard no_grad;
  const Tensor a = full({16}, 1.0);
  CallProfile p(CallTiming::host, /*events=*/true);
  (void)exp(a);
  p.stop();
  (void)exp(a);  // between the spans: not counted, not recorded
  (void)exp(a);
  const double first_span = p.seconds();
  p.resume();
  p.resume();  // running already: nothing changes
  CHECK(p.running());
  (void)exp(a);
  p.stop();
  CHECK(calls(p, "engine.unary:exp") == 2);
  CHECK(p.seconds() >= first_span);
  const std::vector<CallEvent> events = p.events();
  std::vector<double> exp_starts;
  for (const CallEvent& e : events)
    if (e.name == "engine.unary:exp") exp_starts.push_back(e.start);
  REQUIRE(exp_starts.size() == 2);
  CHECK(exp_starts[1] > exp_starts[0]);  // the second span's call keeps its place in time
  std::vector<CallProfileRow> sorted = p.rows();
  std::reverse(sorted.begin(), sorted.end());
  std::sort(sorted.begin(), sorted.end(), most_time_first);
  CHECK(sorted.size() == p.rows().size());
  for (std::size_t i = 0; i < sorted.size(); ++i) CHECK(sorted[i].name == p.rows()[i].name);
}

TEST_CASE("call profile: the tables are the devices' own when none runs") {
  const KernelTable* own = &kernels(Device::cpu());
  const DeviceBackend* own_backend = &device_backend(DeviceType::cpu);
  {
    CallProfile p;
    CHECK(&kernels(Device::cpu()) != own);
    CHECK(&device_backend(DeviceType::cpu) != own_backend);
    // The profiled copy keeps what is not an entry.
    CHECK(std::string(kernels(Device::cpu()).device_name) == own->device_name);
    CHECK(device_backend(DeviceType::cpu).caps.host_readable);
  }
  CHECK(&kernels(Device::cpu()) == own);
  CHECK(&device_backend(DeviceType::cpu) == own_backend);
}

TEST_CASE("call profile: overlapping profiles each see the calls of their own life") {
  NoGradGuard no_grad;
  const Tensor a = full({8}, 1.0);
  CallProfile outer;
  Tensor x = exp(a);
  int64_t inner_unary = 0;
  {
    CallProfile inner;
    x = exp(x);
    x = exp(x);
    inner.stop();
    inner_unary = calls(inner, "engine.unary:exp");
  }
  x = exp(x);
  outer.stop();
  CHECK(inner_unary == 2);
  CHECK(calls(outer, "engine.unary:exp") == 4);
}

TEST_CASE("call profile: the quantizers' and the language models' seams") {
  NoGradGuard no_grad;
  Generator gen(7);
  const Tensor w = randn({4, 64}, gen);
  const Tensor x = randn({3, 16}, gen), weight = full({16}, 1.5);
  CallProfile p;
  const Tensor q = quant::quantize_nf4(w);
  const Tensor y = llm::rms_norm(x, weight);
  p.stop();
  CHECK(calls(p, "quant.nf4_absmax") == 1);
  CHECK(calls(p, "quant.nf4_encode") == 1);
  CHECK(calls(p, "llm.rms_norm") == 1);
}

TEST_CASE("call profile: calls from several threads all count") {
  NoGradGuard no_grad;
  const Tensor a = full({16}, 1.0);
  CallProfile p;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 25; ++i) (void)exp(a);
    });
  for (std::thread& t : threads) t.join();
  p.stop();
  CHECK(calls(p, "engine.unary:exp") == 100);
}

TEST_CASE("call profile: results are the same bits profiled or not") {
  Generator gen(11);
  const Tensor x0 = randn({32, 24}, gen), w = randn({24, 8}, gen);
  const auto run = [&] {
    Tensor x = x0.clone();
    x.requires_grad_();
    Tensor y = softmax(matmul(x, w), 1);
    sum(y * y).backward();
    return std::vector<Tensor>{y.detach(), x.grad()};
  };
  const std::vector<Tensor> plain = run();
  std::vector<Tensor> profiled;
  CallProfile p(CallTiming::device);
  profiled = run();
  p.stop();
  CHECK(calls(p, "engine.gemm") >= 2);  // forward and the input's gradient
  for (std::size_t i = 0; i < plain.size(); ++i)
    CHECK(plain[i].to_vector<float>() == profiled[i].to_vector<float>());
}

TEST_CASE("call profile on sim: the calls of sim's tables, host or device timing") {
  NoGradGuard no_grad;
  const Device dev = Device::sim(0);
  const Tensor a = full({256}, 1.0, {.device = dev});
  synchronize(dev);
  // A job ahead of the profiled kernel on sim's stream: with host timing
  // the call returns before the stream reaches it; with device timing, only
  // after the stream has run it and the kernel.
  for (const CallTiming timing : {CallTiming::host, CallTiming::device}) {
    CAPTURE(static_cast<int>(timing));
    std::atomic<bool> ran{false}, release{false};
    sim::enqueue(0, [&] {
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ran = true;
    });
    CallProfile p(timing);
    if (timing == CallTiming::host) {
      const Tensor b = exp(a);
      CHECK_FALSE(ran.load());  // queued behind the job, not run
      release = true;
    } else {
      std::thread opener([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        release = true;
      });
      const Tensor b = exp(a);
      CHECK(ran.load());  // waited for the stream
      opener.join();
    }
    p.stop();
    synchronize(dev);
    CHECK(calls(p, "engine.unary:exp", DeviceType::sim) == 1);
    CHECK(calls(p, "engine.unary:exp", DeviceType::cpu) == 0);
    CHECK(calls(p, "device.allocate", DeviceType::sim) >= 1);
    // The profile's own waits are not the program's.
    CHECK(calls(p, "device.synchronize", DeviceType::sim) == 0);
  }
  {
    CallProfile p;
    synchronize(dev);
    p.stop();
    CHECK(calls(p, "device.synchronize", DeviceType::sim) == 1);
  }
}

namespace {

// A table of two entries, the first calling the second through the lookup:
// how a call made inside another is counted.
struct TwoEntries {
  const char* device_name;
  void (*outer)(int);
  void (*inner)(int);
};
const TwoEntries& two_entries();
const TwoEntries& looked_up() {
  return profile::kernel_lookup(two_entries(), Device::cpu(), "test",
                                [](auto d, TwoEntries& t, const TwoEntries& s, const char* seam) {
                                  QUANTA_TIME_ENTRY(outer)
                                  QUANTA_TIME_ENTRY(inner)
                                });
}
const TwoEntries& two_entries() {
  static const TwoEntries t{"cpu",
                            [](int n) {
                              for (int i = 0; i < n; ++i) looked_up().inner(i);
                            },
                            [](int) {}};
  return t;
}

}  // namespace

TEST_CASE("call profile: a call made inside another counts in its row, its time once") {
  CallProfile p;
  looked_up().outer(3);
  looked_up().inner(0);
  p.stop();
  CHECK(calls(p, "test.outer") == 1);
  CHECK(calls(p, "test.inner") == 4);
  CHECK(p.calls() == 2);  // the outer call and the inner one made alone
  CHECK(p.seconds() >= row(p, "test.outer").seconds);
  CHECK(p.seconds() <= row(p, "test.outer").seconds + row(p, "test.inner").seconds + 1e-12);
}
