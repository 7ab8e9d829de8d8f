#pragma once
// Learning-rate schedules. A schedule remembers each group's base lr (its lr
// when the schedule was made), sets lr_at(0) at construction, and sets
// lr_at(n) after its n-th step(): call it once after each optimizer.step().
// lr_at is a pure function of the step, so a curve can be inspected without
// stepping.
//
// state_dict(): "step" (i64 0-d, steps taken) and "base_lrs.{g}" (f64 0-d per
// group). The curve's settings (warmup, total, min_lr) are not saved: make the
// schedule with the same settings, then load.
#include <cstdint>
#include <string>
#include <vector>

#include "engine/nn/module.h"
#include "engine/optim/optimizer.h"

namespace quanta {

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  LrSchedule(const LrSchedule&) = delete;
  LrSchedule& operator=(const LrSchedule&) = delete;

  /** The lr of parameter group `group` at step `step`. */
  virtual double lr_at(int64_t step, size_t group = 0) const = 0;
  /** Advances one step and sets every group's lr to lr_at(the new step). */
  void step();
  /** Steps taken so far. */
  int64_t current_step() const { return step_; }
  /** The base lr of each group. */
  const std::vector<double>& base_lrs() const { return base_lrs_; }

  /** "step" and "base_lrs.{g}" (see the top of this file). */
  StateDict state_dict() const;
  /** Restores what state_dict() returned and sets the lrs for that step;
   * the error names every missing, unexpected and mis-shaped key. */
  void load_state_dict(const StateDict& sd);

 protected:
  LrSchedule(const char* name, Optimizer& optimizer);
  /** Sets every group's lr to lr_at(current_step()). */
  void apply();
  [[noreturn]] void fail(const std::string& what) const;

  std::string name_;
  Optimizer& opt_;
  std::vector<double> base_lrs_;
  int64_t step_ = 0;
};

/** Linear warmup to the base lr b, then a decay to min_lr at total_steps
 * whose shape a subclass gives (the fraction of b - min_lr left at step s):
 *   s <  warmup:          b (s + 1) / warmup
 *   warmup <= s < total:  min_lr + (b - min_lr) remaining(s)
 *   s >= total:           min_lr */
class WarmupDecay : public LrSchedule {
 public:
  double lr_at(int64_t step, size_t group = 0) const override;

 protected:
  /** Needs 0 <= warmup_steps <= total_steps and min_lr >= 0. Subclasses
   * call apply() once constructed (it reads remaining()). */
  WarmupDecay(const char* name, Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
              double min_lr);
  /** For warmup <= step < total. */
  virtual double remaining(int64_t step) const = 0;
  int64_t warmup_, total_;
  double min_lr_;
};

/** Cosine decay after the warmup (nanoGPT's schedule):
 * remaining(s) = (1 + cos(pi p)) / 2, p = (s - warmup) / (total - warmup). */
class WarmupCosine : public WarmupDecay {
 public:
  WarmupCosine(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
               double min_lr = 0.0);

 protected:
  double remaining(int64_t step) const override;
};

/** Linear decay after the warmup (transformers'
 * get_linear_schedule_with_warmup, with the warmup of this file):
 * remaining(s) = (total - s) / (total - warmup). */
class WarmupLinearDecay : public WarmupDecay {
 public:
  WarmupLinearDecay(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                    double min_lr = 0.0);

 protected:
  double remaining(int64_t step) const override;
};

/** Linear warmup, then constant: b (s + 1) / warmup for s < warmup, else b. */
class LinearWarmup : public LrSchedule {
 public:
  /** Needs warmup_steps >= 0 (0: constant). */
  LinearWarmup(Optimizer& optimizer, int64_t warmup_steps);
  double lr_at(int64_t step, size_t group = 0) const override;

 private:
  int64_t warmup_;
};

}  // namespace quanta
