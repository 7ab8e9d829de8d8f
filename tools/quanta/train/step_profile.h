#pragma once
// --profile's window over a run (loop.h: ProfileSettings): a CallProfile
// (engine/profile/call_profile.h) that runs during its steps (resumed at
// each, stopped after it, so that the evaluations and logging between them
// are not counted), the host's time in those steps, and what the window
// saw, as log lines, metrics.jsonl's "profile" record and a Chrome trace.
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/profile/call_profile.h"
#include "train/loop.h"

namespace quanta::train {

class StepProfile {
 public:
  /** The window of a run that has `done_steps` of its `total_steps` behind
   * it (more than 0 after --resume), on `device` (the model's). */
  StepProfile(const ProfileSettings& s, Device device, int64_t done_steps, int64_t total_steps);

  /** Before step `step` (1-based) runs: profiles it when it is in the
   * window (the steps alone: not the evaluations and logging between). */
  void before(int64_t step);
  /** After that step, which took the host `seconds`; `last`: the run stops
   * after it. True when the window ended with it: then lines() and
   * record() say what it saw (a device's queue drained first, timed). */
  bool after(double seconds, bool last);

  /** The report: a summary line, then the `top` entries that took the most
   * time, one a line, and what the others took. */
  std::vector<std::string> lines(std::size_t top) const;
  /** The "profile" record (its "step": the window's last step). */
  nlohmann::json record() const;
  /** Writes the window's calls and steps as a Chrome trace to
   * ProfileSettings::trace_path (nothing when it is empty). Returns the log
   * line saying where, or why not: a trace that cannot be written does not
   * stop the run. */
  std::string write_trace() const;

 private:
  // The steps the window ran so far, its last one, and their host time.
  int64_t steps() const { return static_cast<int64_t>(step_spans_.size()); }
  int64_t last() const { return first_ + steps() - 1; }
  double host_seconds() const;

  ProfileSettings s_;
  Device device_;
  int64_t first_ = 0;         // the window's first step; 0: no window
  double drain_seconds_ = 0;  // the device's queue after the last step (0 on the CPU)
  bool ended_ = false;
  // The window's profile, running during its steps only; when it was made
  // (its events' zero) and each step's span from then (the last one's time
  // is 0 while it runs).
  std::unique_ptr<CallProfile> profile_;
  std::chrono::steady_clock::time_point window_start_;
  std::vector<std::pair<double, double>> step_spans_;  // start, seconds
};

}  // namespace quanta::train
