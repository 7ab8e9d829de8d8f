#pragma once
// --profile's window over a run (loop.h: ProfileSettings): a CallProfile
// (engine/profile/call_profile.h) around each of its steps, so that the
// evaluations and logging between them are not counted, the host's time in
// those steps, and what the window saw, as log lines and as metrics.jsonl's
// "profile" record.
#include <chrono>
#include <cstdint>
#include <map>
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
  ProfileSettings s_;
  Device device_;
  int64_t first_ = 0;  // the window's first step; 0: no window
  int64_t last_ = 0;   // the last step run in it so far
  int64_t steps_ = 0;  // steps run in it so far
  double host_seconds_ = 0;
  double drain_seconds_ = 0;  // the device's queue after the last step (0 on the CPU)
  std::unique_ptr<CallProfile> step_profile_;  // of the step running now
  // With a trace: when the window and the step running now started, and the
  // window's events so far (each start from the window's start), with each
  // step's span.
  std::chrono::steady_clock::time_point window_start_, step_start_;
  std::vector<CallEvent> events_;
  std::vector<std::pair<double, double>> step_spans_;  // start, seconds
  // What the window's steps called, by entry and device, most time first
  // once the window ended; and their outermost calls' count and time.
  std::vector<CallProfileRow> rows_;
  int64_t calls_ = 0;
  double table_seconds_ = 0;
  bool ended_ = false;
};

}  // namespace quanta::train
