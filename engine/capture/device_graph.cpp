#include "engine/capture/device_graph.h"

#include <algorithm>
#include <array>
#include <cstring>
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

// Device memory for values a replay makes on the host (a draw's stream, an
// optimizer's lr), with its host copy: the slots are cut from slabs, so a
// replay uploads them in a copy or two, not one per slot.
constexpr std::size_t kSlabBytes = 16 << 10;
constexpr std::size_t kSlotAlign = 16;
struct Slab {
  Tensor device;
  std::vector<unsigned char> host;
  std::size_t used = 0;
};

// A slot: `bytes` at `offset` in slab `slab`, which `write` fills before
// each replay after the first (the captured step wrote its own).
struct Slot {
  std::function<void(void*)> write;
  std::size_t slab = 0, offset = 0, bytes = 0;
};

// What a replay does on the host before queueing the work, in the order
// the captured step did it: a host change, or the writing of a slot.
struct HostStep {
  std::function<void()> change;  // or, when empty,
  std::size_t slot = 0;          // the slot written
};

// The host steps and slots of a capture, kept by its graph.
struct Recorded {
  std::vector<HostStep> host_steps;
  std::vector<Slot> slots;
  std::vector<Slab> slabs;
  int64_t draws = 0;

  void* host_of(const Slot& s) { return slabs[s.slab].host.data() + s.offset; }
};

// The capture open on this thread, if any.
struct Capture {
  Device device;
  Recorded recorded;
  // Each stream drawn so far (key word, start lo, start hi, words) -> its slot.
  std::map<std::tuple<uint64_t, uint64_t, uint64_t, int64_t>, std::size_t> drawn;

  // A new slot of `bytes` (its host bytes zero), written before each later
  // replay by `write`; returns its index.
  std::size_t add_slot(std::size_t bytes, std::function<void(void*)> write) {
    std::vector<Slab>& slabs = recorded.slabs;
    const std::size_t need = (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    if (slabs.empty() || slabs.back().used + need > slabs.back().host.size()) {
      const std::size_t size = std::max(kSlabBytes, need);
      slabs.push_back({empty({static_cast<int64_t>(size)}, {.dtype = DType::u8, .device = device}),
                       std::vector<unsigned char>(size), 0});
    }
    Slot slot{std::move(write), slabs.size() - 1, slabs.back().used, bytes};
    slabs.back().used += need;
    recorded.host_steps.push_back({{}, recorded.slots.size()});
    recorded.slots.push_back(std::move(slot));
    return recorded.slots.size() - 1;
  }
  void* device_of(std::size_t slot) {
    const Slot& s = recorded.slots[slot];
    return static_cast<unsigned char*>(recorded.slabs[s.slab].device.raw_data()) + s.offset;
  }
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
  Recorded recorded;
  bool replayed = false;

  Impl(Device d, const GraphOps* o, void* g, Recorded&& r)
      : device(d), ops(o), graph(g), recorded(std::move(r)) {}
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
  Capture capture{device, {}, {}};
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
  return DeviceGraph(std::make_unique<Impl>(device, ops, graph, std::move(capture.recorded)));
}

void DeviceGraph::replay() {
  if (!impl_) throw std::logic_error("[DeviceGraph] replay of a moved-from graph");
  if (t_capture)
    throw std::logic_error("[DeviceGraph] replay inside a capture of " + t_capture->device.str());
  Impl& g = *impl_;
  Recorded& r = g.recorded;
  // The first replay runs the captured step, whose host part ran at the
  // capture; each later one makes that part again, draws included.
  if (g.replayed) {
    for (const HostStep& h : r.host_steps) {
      if (h.change)
        h.change();
      else
        r.slots[h.slot].write(r.host_of(r.slots[h.slot]));
    }
  }
  for (const Slab& s : r.slabs)
    copy_bytes(s.device.raw_data(), g.device, s.host.data(), Device::cpu(), s.used);
  g.ops->launch(g.graph, g.device.index);
  g.replayed = true;
}

Device DeviceGraph::device() const { return impl_->device; }
int64_t DeviceGraph::recorded_work() const { return impl_->ops->size(impl_->graph); }

int64_t DeviceGraph::host_changes() const {
  int64_t n = 0;
  for (const HostStep& h : impl_->recorded.host_steps) n += h.change ? 1 : 0;
  return n;
}

int64_t DeviceGraph::draws() const { return impl_->recorded.draws; }

bool capturing(Device device) { return t_capture && t_capture->device == device; }
bool capture_open() { return t_capture != nullptr; }

void on_replay(std::function<void()> change) {
  if (t_capture) t_capture->recorded.host_steps.push_back({std::move(change), 0});
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
    return static_cast<const uint64_t*>(c.device_of(it->second));
  if (gen.replay() != Generator::Replay::owner)
    throw std::logic_error(
        "[Generator] a random draw inside a captured step from a stream that may not outlive "
        "the graph (a copy, or a generator no layer owns): a replay could not draw it again");
  Generator* g = &gen;
  const std::size_t slot = c.add_slot(sizeof(StreamWords), [g, words](void* out) {
    const ReplayableDraw replayable;
    const StreamWords next = words_of(g->take(words));
    std::memcpy(out, next.data(), sizeof(StreamWords));
  });
  std::memcpy(c.recorded.host_of(c.recorded.slots[slot]), w.data(), sizeof(StreamWords));
  ++c.recorded.draws;
  c.drawn.emplace(key, slot);
  return static_cast<const uint64_t*>(c.device_of(slot));
}

const double* replay_values(Device device, int64_t count,
                            const std::function<void(double*)>& write) {
  if (!capturing(device))
    throw std::logic_error("[DeviceGraph] replay_values outside a capture of " + device.str());
  if (count <= 0) throw std::invalid_argument("[DeviceGraph] replay_values of no values");
  Capture& c = *t_capture;
  const std::size_t slot = c.add_slot(sizeof(double) * static_cast<std::size_t>(count),
                                      [write](void* out) { write(static_cast<double*>(out)); });
  write(static_cast<double*>(c.recorded.host_of(c.recorded.slots[slot])));
  return static_cast<const double*>(c.device_of(slot));
}

}  // namespace detail

}  // namespace quanta
