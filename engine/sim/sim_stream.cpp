// sim's streams: one SerialWorker per device, never destroyed.
#include "engine/sim/sim_stream.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "engine/cpu/parallel.h"
#include "engine/serial_worker.h"

namespace quanta::sim {
namespace {

struct Streams {
  std::mutex mutex;
  std::map<int, detail::SerialWorker*> by_index;
};
Streams& streams() {
  // Never destroyed, nor are the streams: tensors freed after main's statics
  // still queue their frees.
  static Streams* s = new Streams;
  return *s;
}

// Work still queued when the process exits runs before the statics it may
// use are destroyed.
void drain_at_exit() {
  Streams& s = streams();
  std::map<int, detail::SerialWorker*> all;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    all = s.by_index;
  }
  for (auto& [index, stream] : all) {
    try {
      stream->drain();
    } catch (...) {  // nobody is left to hear of it
    }
  }
}

detail::SerialWorker& stream(int index) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  detail::SerialWorker*& p = s.by_index[index];
  if (!p) {
    if (s.by_index.size() == 1) std::atexit(drain_at_exit);
    p = new detail::SerialWorker;
  }
  return *p;
}

thread_local int current = 0;

}  // namespace

// At most this many jobs wait on a stream: a host further ahead waits for
// the oldest, as a GPU's host blocks when its launch queue (about a thousand
// entries) is full. Without a bound the host ran whole steps ahead, and the
// memory its queued frees would return piled up (a bench of two ranks'
// QLoRA replicas passed 14 GB).
constexpr uint64_t kMaxQueued = 1024;

namespace {

// The queueing thread's OpenMP width: a kernel splits its loops as it would
// have on that thread, so sim keeps the CPU's bits at any --threads (and a
// replay keeps the capture's).
std::function<void()> at_this_width(std::function<void()> work) {
  return [threads = num_threads(), work = std::move(work)] {
    if (num_threads() != threads) set_num_threads(threads);
    work();
  };
}

std::mutex recordings_mutex;
std::map<int, Recorded*> recordings;
// How many devices record: every kernel asks, and almost always none does.
std::atomic<int> recording_devices{0};

Recorded* recording_of(int index) {
  if (recording_devices.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(recordings_mutex);
  const auto it = recordings.find(index);
  return it == recordings.end() ? nullptr : it->second;
}

}  // namespace

void post(int index, std::function<void()> work, bool after_failure) {
  detail::SerialWorker& s = stream(index);
  s.post(at_this_width(std::move(work)), after_failure);
  if (s.on_worker_thread()) return;
  const uint64_t posted = s.posted();
  if (posted > kMaxQueued) s.wait_for(posted - kMaxQueued);
}

void enqueue(int index, std::function<void()> work, bool after_failure) {
  // Frees are never recorded: a replay must not free again.
  if (Recorded* r = after_failure ? nullptr : recording_of(index)) {
    r->push_back(at_this_width(std::move(work)));
    return;
  }
  post(index, std::move(work), after_failure);
}

void set_recording(int index, Recorded* into) {
  std::lock_guard<std::mutex> lock(recordings_mutex);
  if (into)
    recordings[index] = into;
  else
    recordings.erase(index);
  recording_devices.store(static_cast<int>(recordings.size()), std::memory_order_release);
}

void synchronize(int index) { stream(index).drain(); }

Event record_event(int index) { return {index, stream(index).posted()}; }

void wait_event(const Event& event) { stream(event.index).wait_for(event.mark); }

int current_index() { return current; }
void set_current_index(int index) { current = index; }

}  // namespace quanta::sim
