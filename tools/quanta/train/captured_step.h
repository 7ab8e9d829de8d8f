#pragma once
// The training loop's step (forward, backward, clipping, the optimizer
// step) as one DeviceGraph (engine/capture/device_graph.h) on a device that
// records (CUDA, sim): after `warmup` steps run as they are called (k-means
// initialisation and the first optimizer steps make the buffers a steady
// step reads), the step is captured once and then replayed, the batch
// copied into the same device tensors before each replay. Bit for bit the
// step it replaces: the optimizer's lr (the schedule's, set before each
// run) and Adam's bias corrections reach a replay through device memory.
//
// A step whose device draws come from its layers' own streams (noise,
// dropout) is captured: each replay draws that step's numbers. One that
// draws for the host (a random level count) is never captured.
// The quantizers' state update (EMA, dead codes) joins the graph too,
// unless it draws on the host (dead-code replacement picks its rows with a
// host permutation): then it runs as called after each replay, as
// evaluation always does. A step whose batch has other shapes
// than the graph's (the last, smaller batch of an epoch) drops it and is
// captured anew, and so is the next full batch. When three graphs in a row
// serve only the step they were captured in (batches whose shapes change
// from step to step: examples of different lengths), capturing stops and
// every later step runs as called: a capture costs more than it saves.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/capture/device_graph.h"
#include "engine/optim/optimizer.h"
#include "engine/tensor.h"

namespace quanta::train {

class CapturedStep {
 public:
  /** `device`: the model's. */
  CapturedStep(Device device, int64_t warmup);

  /** One step: `body`, its forward and backward, takes the inputs on the
   * device and returns the values to log (a tensor the loop keeps); then
   * `update` (clipping, `optimizer`'s step) reads the gradients; then
   * `after` (may be empty: the quantizers' state update), in the graph
   * when the last step before the capture saw it draw nothing a replay
   * could not draw again, else run as called after each replay. The
   * gradients of `optimizer`'s parameters are zeroed first, except on a
   * replay, which rewrites them. Returns the step's values, the caller's to
   * keep. A step that cannot be captured throws std::runtime_error saying
   * why and how to run without a graph. */
  Tensor run(const std::vector<Tensor>& host_inputs,
             const std::function<Tensor(const std::vector<Tensor>&)>& body,
             const std::function<void()>& update, const std::function<void()>& after,
             Optimizer& optimizer);

  /** Whether the steps after the warm-up keep drawing random numbers a
   * graph cannot draw again (for the host, as a random level count, or from
   * a stream no layer owns): such a step is never captured, and each one is
   * checked again. */
  bool draws() const { return draws_ && uncaptured_ > warmup_; }
  /** Times the step was captured. */
  int64_t captures() const { return captures_; }
  /** Whether the graph held now runs `after` too (false: after each
   * replay, as called). */
  bool after_in_graph() const { return graph_ && after_in_graph_; }
  /** Whether capturing stopped because the batches' shapes kept changing
   * (above). */
  bool stopped() const { return stopped_; }
  /** Kernels and copies one replay queues (0 before a capture). */
  int64_t recorded_work() const { return graph_ ? graph_->recorded_work() : 0; }

 private:
  bool fits(const std::vector<Tensor>& host_inputs) const;
  /** Replays the graph held, then `after` where it is not in the graph;
   * returns the step's values. */
  Tensor replay(const std::function<void()>& after);

  Device device_;
  int64_t warmup_;
  int64_t uncaptured_ = 0;      // steps run as called since the run started
  std::vector<Tensor> inputs_;  // the graph's inputs, on the device
  Tensor values_;               // the graph's output, rewritten by each replay
  std::optional<DeviceGraph> graph_;
  bool draws_ = false;        // the last uncaptured step's body or update drew (above)
  bool after_draws_ = false;  // its `after` did
  bool after_in_graph_ = false;
  int64_t captures_ = 0;
  int64_t replays_ = 0;      // of the graph now held
  int64_t short_lived_ = 0;  // graphs in a row dropped after their own step only
  bool stopped_ = false;
};

}  // namespace quanta::train
