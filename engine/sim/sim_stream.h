#pragma once
// sim's streams: what makes the `sim` device asynchronous, as a GPU is. Each
// sim device has one stream, served by a worker thread of its own: kernels
// and copies queue on it in order and the host goes on at once, so a host
// that reads device memory without waiting for the stream reads a race, and
// a buffer freed while a kernel still uses it is freed too early (ASan sees
// both). The host waits where CUDA's host waits: a copy to the host, a
// collective handing device memory to its transport, synchronize(Device).
// Internal to the engine's sim device and the sim kernel tables.
#include <cstdint>
#include <functional>
#include <vector>

namespace quanta::sim {

/** Queues `work` on device `index`'s stream: it runs on the stream's worker
 * after everything queued before it. An exception it throws is kept and
 * rethrown by the device's next synchronize (a GPU's sticky error); after
 * one, queued work is skipped until then, except work queued with
 * `after_failure` (frees), so no kernel reads what a failed one left. */
void enqueue(int index, std::function<void()> work, bool after_failure = false);

/** What a recording keeps: the jobs, in order, as enqueue would post them. */
using Recorded = std::vector<std::function<void()>>;
/** While `into` is set, enqueue(index, ...) appends to it instead of
 * posting: device `index` records (engine/sim/sim_graph.cpp). Null ends it. */
void set_recording(int index, Recorded* into);
/** Posts `work` on device `index`'s stream even while it records: frees of
 * memory from before the recording, and replays. */
void post(int index, std::function<void()> work, bool after_failure = false);

/** Waits until everything queued on device `index` so far has run, then
 * rethrows the first failure since the last synchronize, if any. */
void synchronize(int index);

/** A point in a sim device's stream: everything queued on it before the
 * point was recorded. What a CUDA event is to a GPU's stream. */
struct Event {
  int index = 0;
  uint64_t mark = 0;
};
/** An event after everything queued on device `index` so far. */
Event record_event(int index);
/** Waits until the work before `event` has run; work queued after it may
 * still run (a kernel failure stays for the next synchronize). */
void wait_event(const Event& event);

/** The sim device whose kernels this thread reaches: kernels(Device::sim(i))
 * and quant_kernels(Device::sim(i)) set it, as CUDA's current device is set,
 * because table entries take raw pointers, not devices. */
int current_index();
void set_current_index(int index);

}  // namespace quanta::sim
