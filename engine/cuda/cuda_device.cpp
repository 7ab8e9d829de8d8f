// CUDA's device table in libquanta: memory and copies forwarded to the CUDA
// module (engine/cuda/module.cpp), which throws naming what is missing when
// it cannot be loaded.
#include <map>
#include <mutex>

#include "engine/cuda/runtime.h"
#include "engine/device_backend.h"
#include "engine/device_error.h"

namespace quanta::cuda {
namespace {

void* allocate(std::size_t nbytes, int index) { return device_malloc(nbytes, index); }
void release(void* p, std::size_t, int index) noexcept { device_free(p, index); }

// One flag per GPU, in mapped host memory: kernels write it, the host reads
// it after the copy that ends a read of that GPU, without another copy.
DeviceErrorFlag* error_flag(int index) {
  static std::mutex mutex;
  static std::map<int, DeviceErrorFlag*>* flags = new std::map<int, DeviceErrorFlag*>;
  std::lock_guard<std::mutex> lock(mutex);
  DeviceErrorFlag*& f = (*flags)[index];
  if (!f) f = static_cast<DeviceErrorFlag*>(mapped_host_alloc(sizeof(DeviceErrorFlag)));
  return f;
}

const GraphOps kGraphOps{
    // The error flag is made at a device's first checked op; cudaHostAlloc
    // may not run while the stream is captured, so it exists before.
    .begin =
        [](int device) {
          error_flag(device);
          begin_capture(device);
        },
    .end = end_capture,
    .launch = launch_graph,
    .size = graph_nodes,
    .destroy = [](void* graph, int) noexcept { destroy_graph(graph); },
};

}  // namespace

const DeviceBackend& backend() {
  // cuDNN takes channels-last convolutions as they are (the im2col path
  // transposes them). Whether they run faster than channels first on a GPU
  // is not yet measured, so models free to choose keep channels first.
  static const DeviceBackend b{
      .name = "cuda",
      .caps = {.channels_last_conv = true, .prefers_channels_last = false, .host_readable = false},
      .allocate = allocate,
      .release = release,
      .copy = copy,
      .error_flag = error_flag,
      .synchronize = synchronize,
      .graph = &kGraphOps,
  };
  return b;
}

}  // namespace quanta::cuda
