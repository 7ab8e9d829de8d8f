#pragma once
// Where a step's time goes, op family by op family, on any device and
// without an outside profiler: while a CallProfile lives, every call through
// a kernel table (the engine's, the quantizers', the language models') and
// through a device's own table (its memory, copies and synchronisation) is
// counted and timed, per entry.
//
//   CallProfile profile;                      // CallTiming::host
//   for (int i = 0; i < 5; ++i) step();
//   profile.stop();
//   for (const CallProfileRow& r : profile.rows()) ...   // "engine.conv", 15 calls, 2.1 ms
//
// With CallTiming::host a call's time is what it costs the calling thread:
// on the CPU the kernel itself; on a GPU (or sim) the host's share of a
// launch (argument checks, plan lookups, the driver's queueing), which is
// what a step that is not captured as a graph waits on when its kernels are
// small. With CallTiming::device the device is synchronised after each
// call, so its time also holds the device's work (and each kernel then runs
// alone: the sum is no step's real time). Profiling changes no result.
//
// Only calls made through the tables' lookups (kernels(), quant_kernels(),
// llm_kernels(), device_backend()) are seen; a call that makes another
// through a lookup counts in both rows, its time once in seconds().
// Collectives are rows too ("dist.all_reduce", from the call to its return
// on whichever thread makes it), but not part of calls() and seconds():
// DataParallel's run on a thread of their own, beside the step's kernels.
// A replayed DeviceGraph makes no calls: profile steps run as called.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"

namespace quanta {

/** What a profiled call's time holds (above). */
enum class CallTiming { host, device };

/** One table entry's calls, on one type of device, while a profile ran. */
struct CallProfileRow {
  /** The seam and the entry: "engine.conv", "quant.nearest_codes",
   * "llm.attention", "device.copy"; with the op where the entry takes one
   * (the elementwise families, the reductions): "engine.binary:mul",
   * "engine.reduce_rows:sum". */
  std::string name;
  /** The device type whose table it is (a step on a GPU still makes some
   * calls on the CPU: its batch gathered on the host). */
  DeviceType device = DeviceType::cpu;
  int64_t calls = 0;
  /** Time inside those calls, each counted from its start to its return
   * (and, with CallTiming::device, to the device's being done with it). */
  double seconds = 0;
};

/** The order of CallProfile::rows(): the most time first, then by name,
 * then by device (for a caller that merges or sorts rows of its own). */
bool most_time_first(const CallProfileRow& a, const CallProfileRow& b);

/** One call as a timeline event (CallProfile's `events`): when it started,
 * how long it took, on which thread. */
struct CallEvent {
  std::string name;  // as CallProfileRow's
  DeviceType device = DeviceType::cpu;
  /** Seconds from the profile's start to the call's start, and the call's
   * time (as the profile's timing counts it). */
  double start = 0, seconds = 0;
  /** The calling thread, numbered from 0 in the order threads first made
   * a profiled call in this process. */
  int thread = 0;
};

/** Counts and times the calls made, by any thread, while it runs: from its
 * making to stop(), and again from each resume() to the next stop().
 * Profiles may overlap: each sees the calls made while it runs; while one
 * with CallTiming::device runs, every profile's calls wait for the
 * device. Costs nothing measurable when none lives (one atomic load
 * per table lookup). */
class CallProfile {
 public:
  /** `events`: also keep every call as a CallEvent (memory grows with the
   * calls: for a few steps, not a whole run). */
  explicit CallProfile(CallTiming timing = CallTiming::host, bool events = false);
  ~CallProfile();
  CallProfile(const CallProfile&) = delete;
  CallProfile& operator=(const CallProfile&) = delete;

  /** Stops counting: what rows(), the totals and events() say stays as it
   * is now until resume(). */
  void stop();
  /** Counts again after stop() (the spans between are left out: a training
   * loop's evaluations between profiled steps); no-op while running. */
  void resume();
  bool running() const { return running_; }
  CallTiming timing() const { return timing_; }

  /** The entries called, the most time first (ties: by name, then
   * device; most_time_first). */
  std::vector<CallProfileRow> rows() const;
  /** Calls made from outside any other profiled call, and their time: what
   * the rows add up to without the calls made inside others. */
  int64_t calls() const;
  double seconds() const;
  /** The calls in the order they ended (each thread's in its own order),
   * when made with `events`; else none. Each start counts from the
   * profile's making, so resumed spans keep their place on the timeline
   * that Chrome's and Perfetto's trace viewers show. */
  std::vector<CallEvent> events() const;

 private:
  /** Every counter's calls and time: at one moment, or summed over spans
   * (call_profile.cpp). */
  struct Counts;
  /** The calls recorded while it runs with `events` (call_profile.cpp). */
  struct Recording;

  /** What the spans ended so far counted, plus the running one's. */
  Counts counted() const;

  CallTiming timing_;
  bool running_ = false;
  std::unique_ptr<Counts> span_start_;  // the counters when the running span began
  std::unique_ptr<Counts> ended_;       // the spans ended so far, summed
  std::shared_ptr<Recording> recording_;
};

}  // namespace quanta
