#include "engine/capture/device_graph.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/device_backend.h"
#include "engine/host_sync.h"

namespace quanta {
namespace {

// The capture open on this thread, if any.
struct Capture {
  Device device;
  std::vector<std::function<void()>> changes;
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
  std::vector<std::function<void()>> changes;

  Impl(Device d, const GraphOps* o, void* g, std::vector<std::function<void()>> c)
      : device(d), ops(o), graph(g), changes(std::move(c)) {}
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
  Capture capture{device, {}};
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
  return DeviceGraph(std::make_unique<Impl>(device, ops, graph, std::move(capture.changes)));
}

void DeviceGraph::replay() {
  if (!impl_) throw std::logic_error("[DeviceGraph] replay of a moved-from graph");
  if (t_capture)
    throw std::logic_error("[DeviceGraph] replay inside a capture of " + t_capture->device.str());
  impl_->ops->launch(impl_->graph, impl_->device.index);
  for (const auto& change : impl_->changes) change();
}

Device DeviceGraph::device() const { return impl_->device; }
int64_t DeviceGraph::recorded_work() const { return impl_->ops->size(impl_->graph); }
int64_t DeviceGraph::host_changes() const { return static_cast<int64_t>(impl_->changes.size()); }

bool capturing(Device device) { return t_capture && t_capture->device == device; }
bool capture_open() { return t_capture != nullptr; }

void on_replay(std::function<void()> change) {
  if (t_capture) t_capture->changes.push_back(std::move(change));
}

}  // namespace quanta
