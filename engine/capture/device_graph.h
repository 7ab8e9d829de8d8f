#pragma once
// Device work recorded once and queued again as a whole: what a CUDA graph
// is to a stream. A training step that issues a few hundred kernels costs the
// host a launch each, every step; captured, the host queues one graph.
//
//   Tensor x = empty({B, C, H, W}, {.device = gpu});   // the step's input, in place
//   DeviceGraph step = DeviceGraph::capture(gpu, [&] { loss = model(x) ... backward(); });
//   for (...) { copy_(x, next_batch); step.replay(); }
//
// Capture runs `work` on the host with the device's kernels and copies
// recorded, not run: its results exist only after a replay. A replay queues
// exactly what was recorded, with the same pointers and the same arguments,
// so what is meant to change between replays must live in device memory that
// the step reads (its inputs copied in place before each replay), never in a
// kernel's arguments. The optimizers' learning rate and Adam's bias
// corrections change every step: captured, their kernels read them from
// device memory a replay rewrites (detail::replay_values). Memory
// allocated while capturing belongs to the graph until it is destroyed: the
// tensors the step made and kept (gradients, the loss) are rewritten at each
// replay, and memory the step freed is not handed to anyone else.
//
// The first replay runs the captured step itself, whose host part ran
// while capturing. Each later replay is one more step: before queueing the
// work it makes that host part again, in the captured order: the changes
// recorded with on_replay (a counter, the handles of tensors the step leaves
// for later), the random draws, and the values kernels read from device
// memory (an optimizer's lr). A device fill drawn inside a capture
// (engine/random/sampling.h) reads its stream from device memory that each
// replay rewrites with the stream the generator gives then, so every step
// draws its own numbers, as uncaptured; its generator must be a layer's own
// (Generator::set_replayable), which outlives the graph.
//
// Refused inside a capture, each with a std::logic_error naming it: a copy
// to the host (a host sync: HostSyncGuard), a copy from the host (a replay
// would copy the capture's bytes again), synchronize(device), a draw for the
// host or from a generator no layer owns, and capture on a device that
// cannot record (the CPU runs ops as they are called).
#include <cstdint>
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

  /** Queues the recorded work: the first time, the captured step; later,
   * one more step, its host changes (on_replay) and draws made first (see
   * above). Asynchronous, as any kernel is. */
  void replay();

  Device device() const;
  /** Kernels and copies recorded (what one replay queues). */
  int64_t recorded_work() const;
  /** Host changes recorded with on_replay. */
  int64_t host_changes() const;
  /** Random draws a replay makes again. */
  int64_t draws() const;

 private:
  struct Impl;
  explicit DeviceGraph(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/** Whether this thread is capturing work of `device`. */
bool capturing(Device device);
/** Whether this thread is capturing work of any device. */
bool capture_open();

/** Inside a capture: keeps `change`, which each replay after the first
 * runs on the host, in the captured order, before queueing the work. The
 * captured run has made the change itself already; `change` repeats it for
 * the steps the replays are. Outside a capture: nothing. */
void on_replay(std::function<void()> change);

class Generator;
namespace detail {
/** For a device fill of `device` inside its capture (engine/random/
 * sampling.cpp): takes `n_words` words from `gen` as the captured step
 * draws them and returns where the fill's kernel reads its stream
 * (RandomFill::stream_at), rewritten before each later replay from `gen`
 * (an owner) or, for a stream an earlier draw of the capture took, that
 * draw's. */
const uint64_t* captured_stream(Device device, Generator& gen, int64_t n_words);

/** Inside a capture of `device`: `count` doubles of device memory for what
 * a kernel reads that changes from step to step (an optimizer's lr and bias
 * corrections: SgdStep::live, AdamStep::live). `write` fills them on the
 * host: at once, for the captured step, and in each later replay at its
 * place among the replay's host steps (after the on_replay changes recorded
 * before it); the values reach the device before the replay's work runs.
 * Throws std::logic_error outside a capture of `device`. */
const double* replay_values(Device device, int64_t count,
                            const std::function<void(double*)>& write);
}  // namespace detail

}  // namespace quanta
