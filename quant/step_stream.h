#pragma once
// The random draws a quantizer makes inside its forward (quantize dropout,
// stochastic code sampling, entropy subsampling, orthogonal-loss code
// subsets), and how they stay identical on every rank.
//
// Unpinned (a single process, the default) a StepStream is one stream
// continued draw after draw, as the reference's global RNG. A distributed run
// pins it to the optimizer step (quant::QuantizerSync does, at every
// reconciliation): then every draw of step s starts from the same place,
// Philox offset {lo = 0, hi = s} of the layer's named stream, so all ranks
// draw the same numbers for that step with no communication, and a rank that
// runs an extra forward, an eval or a no-grad forward cannot shift them.
#include <cstdint>

#include "engine/capture/device_graph.h"
#include "engine/random/generator.h"

namespace quanta::quant {

class StepStream {
 public:
  explicit StepStream(Generator gen) : gen_(gen), base_(gen) { gen_.set_replayable(); }
  StepStream(const StepStream& other) : StepStream(other.base_) {
    gen_ = other.gen_;
    pinned_ = other.pinned_;
    step_ = other.step_;
  }
  StepStream& operator=(const StepStream& other) = default;

  /** The generator this forward's draws come from (see above). Its device
   * draws replay in a captured step (engine/capture/device_graph.h): the
   * pinning below is made again at each replay, with the step then. */
  Generator& next() {
    if (pinned_) {
      restart();
      on_replay([this] { restart(); });
    }
    return gen_;
  }
  /** From now on, draws are keyed by `step` instead of continuing. */
  void pin(uint64_t step) {
    pinned_ = true;
    step_ = step;
  }
  bool pinned() const { return pinned_; }
  uint64_t step() const { return step_; }

 private:
  void restart() {
    gen_ = base_;
    gen_.set_offset({0, step_});
  }

  Generator gen_, base_;
  bool pinned_ = false;
  uint64_t step_ = 0;
};

/** Implemented by layers that own StepStreams: QuantizerSync pins them all to
 * the current step at every reconciliation. */
class StepKeyed {
 public:
  virtual ~StepKeyed() = default;
  /** Pins every random stream of this layer (not of its sublayers) to `step`. */
  virtual void pin_random_step(uint64_t step) = 0;
};

}  // namespace quanta::quant
