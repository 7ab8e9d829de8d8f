#pragma once
// One table per kind of device: its memory, its copies to and from the host,
// and the capabilities ops read when they choose a path. Storage and
// copy_bytes go through it and never ask which device they hold; adding a
// device is one more table (engine/sim/sim_device.cpp is the worked example,
// docs/design.md says how). The kernels are the device's KernelTable
// (engine/kernels/table.h), reached through kernels(Device).
#include <cstddef>
#include <cstdint>

#include "engine/device.h"

namespace quanta {

struct DeviceErrorFlag;

/** What a device's kernels do natively, read where an op picks a path
 * (instead of asking whether the device is the CPU). */
struct DeviceCaps {
  /** conv2d takes channels-last (NHWC) activations without permuting them
   * (with one group; the op layer permutes grouped ones). */
  bool channels_last_conv = false;
  /** The layout a model free to choose (quanta train's VQ-VAE) keeps its
   * activations in on this device: channels last where that was measured
   * faster than channels first (the CPU's kernels compute in NHWC). */
  bool prefers_channels_last = false;
  /** Its bytes are this process's ordinary memory (the host may read them
   * directly, without a copy: the CPU alone; sim's memory is host memory
   * too, but reading it is a counted copy, as on a GPU). */
  bool host_readable = false;
};

/** How a device records its queued work for a DeviceGraph
 * (engine/capture/device_graph.h). */
struct GraphOps {
  /** From here on, the work queued on device `index` (kernels, copies on the
   * device) is recorded instead of run, and memory allocated on it belongs
   * to the recording. */
  void (*begin)(int index);
  /** Ends the recording: the graph, which owns that memory. */
  void* (*end)(int index);
  /** Queues the recorded work once more. */
  void (*launch)(void* graph, int index);
  /** How many kernels and copies the recording holds. */
  int64_t (*size)(const void* graph);
  /** Returns the graph and, once the replays queued before are done, the
   * memory it owns that nothing holds any more; memory still held by a
   * tensor returns when that tensor lets it go. */
  void (*destroy)(void* graph, int index) noexcept;
};

struct DeviceBackend {
  const char* name;
  DeviceCaps caps;
  /** nbytes (> 0) of uninitialised memory on device `index`; throws on failure. */
  void* (*allocate)(std::size_t nbytes, int index);
  /** Returns memory from allocate. Never throws. */
  void (*release)(void* ptr, std::size_t nbytes, int index) noexcept;
  /** nbytes between this device and the host, or within devices of this
   * type; ordered after every kernel queued before it and before every one
   * queued after it. The host may reuse its memory when it returns; a copy
   * to the device may still be in flight then (CUDA queues small uploads),
   * a copy to the host is done. */
  void (*copy)(void* dst, Device dst_device, const void* src, Device src_device,
               std::size_t nbytes);
  /** The error flag of device `index` (engine/device_error.h), made on first
   * use; null for the CPU, which checks on the host. */
  DeviceErrorFlag* (*error_flag)(int index) = nullptr;
  /** Waits until everything queued on device `index` has run and reports a
   * failure of queued work; null for the CPU, which queues nothing. */
  void (*synchronize)(int index) = nullptr;
  /** Null where the device cannot record work (the CPU runs ops as they
   * are called). */
  const GraphOps* graph = nullptr;
};

/** The table of devices of type `type`. */
const DeviceBackend& device_backend(DeviceType type);
inline const DeviceCaps& device_caps(Device device) { return device_backend(device.type).caps; }

namespace detail {
/** Counts one copy in device_stats (copy_bytes calls it; so does a backend
 * that copies by other means). A device-to-host copy is a host sync, which a
 * HostSyncGuard or QUANTA_HOST_SYNC may refuse (it throws before copying). */
void count_copy(Device dst, Device src, std::size_t nbytes);
/** Counts sim allocations for device_stats. */
void count_allocation(Device device, std::size_t nbytes, bool taken);
}  // namespace detail

}  // namespace quanta
