// The `sim` device's table: a GPU stand-in that every machine has. Its memory
// is host memory of its own (aligned like the CPU's, so the CPU's kernels run
// on it and give the CPU's bits), counted in device_stats. Its kernels and
// copies run asynchronously, in order, on the device's stream (engine/sim/
// sim_stream.h): a copy to the host waits for the stream, one from the host
// queues a snapshot of the host's bytes, a free waits its turn. What else
// makes it a GPU from the host's side lives elsewhere, unchanged for it:
// tensors of two devices refuse to meet in an op (common_device),
// Tensor::data<T> refuses a device tensor, and every read from the host is a
// device-to-host copy, a host sync that a HostSyncGuard can forbid. Kernels
// check indices as a GPU's do: into the error flag, reported at the next read.
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "engine/device_backend.h"
#include "engine/device_error.h"
#include "engine/sim/sim_graph.h"
#include "engine/sim/sim_stream.h"

namespace quanta::sim {
namespace {

constexpr std::size_t kAlignment = 64;

void* allocate(std::size_t nbytes, int index) {
  const std::size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) throw std::bad_alloc();
  detail::count_allocation(Device::sim(index), nbytes, true);
  note_allocation(p, index);
  return p;
}

// Stream-ordered, as CUDA's caching allocator is: kernels queued before the
// free still read and write the memory.
void release(void* p, std::size_t nbytes, int index) noexcept {
  if (kept_by_graph(p, nbytes)) return;  // a replay writes it again
  detail::count_allocation(Device::sim(index), nbytes, false);
  try {
    enqueue(
        index, [p] { std::free(p); }, /*after_failure=*/true);
  } catch (...) {  // no memory to queue with: wait for the stream instead
    try {
      synchronize(index);
    } catch (...) {  // a kernel's failure: its report waits for the next read
    }
    std::free(p);
  }
}

void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t nbytes) {
  if (dst_device.is_cpu()) {  // a read: everything queued before it has run
    synchronize(src_device.index);
    std::memcpy(dst, src, nbytes);
  } else if (src_device.is_cpu()) {  // the host may reuse src on return
    std::shared_ptr<unsigned char[]> bytes(new unsigned char[nbytes]);
    std::memcpy(bytes.get(), src, nbytes);
    enqueue(dst_device.index, [dst, bytes, nbytes] { std::memcpy(dst, bytes.get(), nbytes); });
  } else if (dst_device.index == src_device.index) {
    enqueue(dst_device.index, [dst, src, nbytes] { std::memcpy(dst, src, nbytes); });
  } else {  // between two sim devices: both drained, then a host copy
    synchronize(src_device.index);
    synchronize(dst_device.index);
    std::memcpy(dst, src, nbytes);
  }
}

// One flag per device index, in host memory as all of sim's is; kernels on
// the stream write it, the host reads it after a synchronize.
DeviceErrorFlag* error_flag(int index) {
  static std::mutex mutex;
  static std::map<int, DeviceErrorFlag>* flags = new std::map<int, DeviceErrorFlag>;
  std::lock_guard<std::mutex> lock(mutex);
  return &(*flags)[index];
}

}  // namespace

const DeviceBackend& backend() {
  // The CPU's kernels, so its layouts: the results are the CPU's bits.
  static const DeviceBackend b{
      .name = "sim",
      .caps = {.channels_last_conv = true, .prefers_channels_last = true, .host_readable = false},
      .allocate = allocate,
      .release = release,
      .copy = copy,
      .error_flag = error_flag,
      .synchronize = synchronize,
      .graph = &graph_ops(),
  };
  return b;
}

}  // namespace quanta::sim
