#include "engine/capture/device_graph.h"

#include <array>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/device_backend.h"
#include "engine/factory.h"
#include "engine/host_sync.h"
#include "engine/random/generator.h"
#include "engine/storage.h"

namespace quanta {
namespace {

// A device fill's stream as its kernel reads it (RandomFill::stream_at).
using StreamWords = std::array<uint64_t, 3>;

StreamWords words_of(const PhiloxStream& s) {
  return {uint64_t(s.key[0]) | uint64_t(s.key[1]) << 32, s.start.lo, s.start.hi};
}

// A draw the graph makes again at each replay: from `gen`, `words` words,
// its stream written to `slot` (on the device) before the replay's launch.
struct Draw {
  Generator* gen = nullptr;
  int64_t words = 0;
  Tensor slot;
  StreamWords stream{};  // the capture's, then each replay's
};

// What a replay does on the host before queueing the work, in the order
// the captured step did it: a host change, or a draw.
struct HostStep {
  std::function<void()> change;  // or, when empty,
  std::size_t draw = 0;          // the draw
};

// The capture open on this thread, if any.
struct Capture {
  Device device;
  std::vector<HostStep> host_steps;
  std::vector<Draw> draws;
  // Each stream drawn so far (key word, start lo, start hi, words) -> its draw.
  std::map<std::tuple<uint64_t, uint64_t, uint64_t, int64_t>, std::size_t> drawn;
};
thread_local Capture* t_capture = nullptr;

const GraphOps* graph_ops(Device device) {
  return device.is_cpu() ? nullptr : device_backend(device.type).graph;
}

}  // namespace

struct DeviceGraph::Impl {
  Device device;
  const GraphOps* ops = nullptr;
  void* graph = nullptr;
  std::vector<HostStep> host_steps;
  std::vector<Draw> draws;
  bool replayed = false;

  Impl(Device d, const GraphOps* o, void* g, Capture&& c)
      : device(d),
        ops(o),
        graph(g),
        host_steps(std::move(c.host_steps)),
        draws(std::move(c.draws)) {}
  ~Impl() {
    if (graph) ops->destroy(graph, device.index);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
};

DeviceGraph::DeviceGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceGraph::DeviceGraph(DeviceGraph&&) noexcept = default;
DeviceGraph& DeviceGraph::operator=(DeviceGraph&&) noexcept = default;
DeviceGraph::~DeviceGraph() = default;

DeviceGraph DeviceGraph::capture(Device device, const std::function<void()>& work) {
  if (t_capture)
    throw std::logic_error("[DeviceGraph] a capture of " + t_capture->device.str() +
                           " is already open on this thread; captures do not nest");
  const GraphOps* ops = graph_ops(device);
  if (!ops)
    throw std::invalid_argument("[DeviceGraph] " + device.str() + " cannot record work: " +
                                (device.is_cpu()
                                     ? std::string("the CPU runs ops as they are called")
                                     : "its backend has no graphs in this build"));
  Capture capture{device, {}, {}, {}};
  ops->begin(device.index);
  t_capture = &capture;
  try {
    // A read of the device would wait for work that has not run.
    const HostSyncGuard no_reads("a captured step on " + device.str() +
                                 " (its work runs at replay, so nothing it computes "
                                 "can be read while capturing)");
    work();
  } catch (...) {
    t_capture = nullptr;
    try {
      ops->destroy(ops->end(device.index), device.index);
    } catch (...) {  // a capture the failure broke: the failure is the one to report
    }
    throw;
  }
  t_capture = nullptr;
  void* graph = ops->end(device.index);
  return DeviceGraph(std::make_unique<Impl>(device, ops, graph, std::move(capture)));
}

void DeviceGraph::replay() {
  if (!impl_) throw std::logic_error("[DeviceGraph] replay of a moved-from graph");
  if (t_capture)
    throw std::logic_error("[DeviceGraph] replay inside a capture of " + t_capture->device.str());
  Impl& g = *impl_;
  // The first replay runs the captured step, whose host part ran at the
  // capture; each later one makes that part again, draws included.
  if (g.replayed) {
    for (const HostStep& h : g.host_steps) {
      if (h.change) {
        h.change();
        continue;
      }
      Draw& d = g.draws[h.draw];
      const detail::ReplayableDraw replayable;
      d.stream = words_of(d.gen->take(d.words));
    }
  }
  for (const Draw& d : g.draws)
    copy_bytes(d.slot.raw_data(), g.device, d.stream.data(), Device::cpu(), sizeof(StreamWords));
  g.ops->launch(g.graph, g.device.index);
  g.replayed = true;
}

Device DeviceGraph::device() const { return impl_->device; }
int64_t DeviceGraph::recorded_work() const { return impl_->ops->size(impl_->graph); }

int64_t DeviceGraph::host_changes() const {
  int64_t n = 0;
  for (const HostStep& h : impl_->host_steps) n += h.change ? 1 : 0;
  return n;
}

int64_t DeviceGraph::draws() const { return static_cast<int64_t>(impl_->draws.size()); }

bool capturing(Device device) { return t_capture && t_capture->device == device; }
bool capture_open() { return t_capture != nullptr; }

void on_replay(std::function<void()> change) {
  if (t_capture) t_capture->host_steps.push_back({std::move(change), 0});
}

namespace detail {

const uint64_t* captured_stream(Device device, Generator& gen, int64_t words) {
  if (!capturing(device))
    throw std::logic_error("[DeviceGraph] captured_stream outside a capture of " + device.str());
  Capture& c = *t_capture;
  PhiloxStream s;
  {
    const ReplayableDraw replayable;
    s = gen.take(words);  // the captured step's own draw, as it runs now
  }
  const StreamWords w = words_of(s);
  const auto key = std::make_tuple(w[0], w[1], w[2], words);
  // The same stream again (dropout's backward): the same slot, so each
  // replay's two draws stay one.
  if (const auto it = c.drawn.find(key); it != c.drawn.end())
    return static_cast<const uint64_t*>(c.draws[it->second].slot.raw_data());
  if (gen.replay() != Generator::Replay::owner)
    throw std::logic_error(
        "[Generator] a random draw inside a captured step from a stream that may not outlive "
        "the graph (a copy, or a generator no layer owns): a replay could not draw it again");
  Draw d;
  d.gen = &gen;
  d.words = words;
  d.slot = empty({3}, {.dtype = DType::i64, .device = device});
  d.stream = w;
  c.drawn.emplace(key, c.draws.size());
  c.host_steps.push_back({{}, c.draws.size()});
  c.draws.push_back(std::move(d));
  return static_cast<const uint64_t*>(c.draws.back().slot.raw_data());
}

}  // namespace detail

}  // namespace quanta
