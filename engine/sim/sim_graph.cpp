#include "engine/sim/sim_graph.h"

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/sim/sim_stream.h"

namespace quanta::sim {
namespace {

struct SimGraph {
  int index = 0;
  // Shared with the replays still queued when the graph is destroyed.
  std::shared_ptr<Recorded> work = std::make_shared<Recorded>();
  std::vector<void*> owned;                         // allocated while recording
  std::unordered_map<void*, std::size_t> released;  // owned, and let go by the host
};

struct Registry {
  std::mutex mutex;
  std::map<int, SimGraph*> recording;             // by device index
  std::unordered_map<void*, SimGraph*> owner_of;  // memory graphs own
};
Registry& registry() {
  static Registry* r = new Registry;  // tensors may outlive main's statics
  return *r;
}

void begin(int index) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.recording.count(index))
    throw std::logic_error("[DeviceGraph] sim:" + std::to_string(index) + " is already recording");
  auto* g = new SimGraph;
  g->index = index;
  r.recording[index] = g;
  set_recording(index, g->work.get());
}

void* end(int index) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.recording.find(index);
  if (it == r.recording.end())
    throw std::logic_error("[DeviceGraph] sim:" + std::to_string(index) + " is not recording");
  SimGraph* g = it->second;
  r.recording.erase(it);
  set_recording(index, nullptr);
  return g;
}

void launch(void* graph, int index) {
  auto* g = static_cast<SimGraph*>(graph);
  post(index, [work = g->work] {
    for (const auto& job : *work) job();
  });
}

int64_t size(const void* graph) {
  return static_cast<int64_t>(static_cast<const SimGraph*>(graph)->work->size());
}

void destroy(void* graph, int index) noexcept {
  auto* g = static_cast<SimGraph*>(graph);
  Registry& r = registry();
  std::vector<std::pair<void*, std::size_t>> to_free;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (void* p : g->owned) {
      r.owner_of.erase(p);
      const auto it = g->released.find(p);
      if (it != g->released.end()) to_free.emplace_back(p, it->second);
    }
  }
  for (const auto& [p, nbytes] : to_free) {
    detail::count_allocation(Device::sim(index), nbytes, false);
    try {
      post(
          index, [p = p] { std::free(p); }, /*after_failure=*/true);
    } catch (...) {  // no memory to queue with: wait for the replays instead
      try {
        synchronize(index);
      } catch (...) {  // a kernel's failure: its report waits for the next read
      }
      std::free(p);
    }
  }
  delete g;
}

}  // namespace

const GraphOps& graph_ops() {
  static const GraphOps ops{
      .begin = begin, .end = end, .launch = launch, .size = size, .destroy = destroy};
  return ops;
}

void note_allocation(void* ptr, int index) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.recording.find(index);
  if (it == r.recording.end()) return;
  it->second->owned.push_back(ptr);
  r.owner_of[ptr] = it->second;
}

bool kept_by_graph(void* ptr, std::size_t nbytes) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.owner_of.find(ptr);
  if (it == r.owner_of.end()) return false;
  it->second->released[ptr] = nbytes;
  return true;
}

}  // namespace quanta::sim
