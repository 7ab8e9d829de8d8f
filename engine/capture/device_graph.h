#pragma once
// Device work recorded once and queued again as a whole: what a CUDA graph
// is to a stream. A training step that issues a few hundred kernels costs the
// host a launch each, every step; captured, the host queues one graph.
//
//   Tensor x = empty({B, C, H, W}, {.device = gpu});   // the step's input, in place
//   DeviceGraph step = DeviceGraph::capture(gpu, [&] { loss = model(x) ... backward(); });
//   for (...) { x.copy_(next_batch); step.replay(); }
//
// Capture runs `work` on the host with the device's kernels and copies
// recorded, not run: its results exist only after a replay. A replay queues
// exactly what was recorded, with the same pointers and the same arguments,
// so what is meant to change between replays must live in device memory that
// the step reads (its inputs copied in place before each replay, a learning
// rate in a device scalar), never in a kernel's arguments. Memory allocated
// while capturing belongs to the graph until it is destroyed: the tensors the
// step made and kept (gradients, the loss) are rewritten at each replay,
// and memory the step freed is not handed to anyone else.
//
// Refused inside a capture, each with a std::logic_error naming it: a copy
// to the host (a host sync: HostSyncGuard), a copy from the host (a replay
// would copy the capture's bytes again), synchronize(device), a random draw
// (its stream's key and offset are a kernel's arguments: every replay would
// draw the same numbers), and capture on a device that cannot record (the
// CPU runs ops as they are called). Host state the step changes (a counter,
// the handles of tensors it leaves for later) is not replayed by the device:
// code that changes it inside a capture records the change with on_replay,
// and each replay makes it again.
#include <functional>
#include <memory>

#include "engine/device.h"

namespace quanta {

class DeviceGraph {
 public:
  /** Runs `work` with `device`'s work recorded (see above). If `work`
   * throws, nothing is kept and the exception propagates. Throws
   * std::invalid_argument for a device that cannot record, and
   * std::logic_error when a capture is already open on this thread. */
  static DeviceGraph capture(Device device, const std::function<void()>& work);

  DeviceGraph(DeviceGraph&&) noexcept;
  DeviceGraph& operator=(DeviceGraph&&) noexcept;
  /** The graph's memory is returned once its queued replays are done;
   * tensors made while capturing that are still held keep theirs. */
  ~DeviceGraph();

  /** Queues the recorded work once more, then makes the recorded host
   * changes (on_replay). Asynchronous, as any kernel is. */
  void replay();

  Device device() const;
  /** Kernels and copies recorded (what one replay queues). */
  int64_t recorded_work() const;
  /** Host changes recorded with on_replay. */
  int64_t host_changes() const;

 private:
  struct Impl;
  explicit DeviceGraph(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/** Whether this thread is capturing work of `device`. */
bool capturing(Device device);
/** Whether this thread is capturing work of any device. */
bool capture_open();

/** Inside a capture: keeps `change`, which the graph's replays then run on
 * the host after queueing the recorded work. The captured run has made the
 * change itself already; `change` repeats it. Outside a capture: nothing. */
void on_replay(std::function<void()> change);

}  // namespace quanta
