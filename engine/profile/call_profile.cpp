// CallProfile and the counters behind it: a profile is two snapshots of
// every entry's running counts, its rows their differences.
#include "engine/profile/call_profile.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "engine/capture/device_graph.h"
#include "engine/device_backend.h"
#include "engine/profile/timed_table.h"

namespace quanta {
namespace profile {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<EntryCounter*> counters;
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: counters outlive main's statics
  return *r;
}

std::atomic<int> g_profiles{0};         // CallProfiles alive
std::atomic<int> g_device_profiles{0};  // of them, CallTiming::device
EntryCounter g_outermost;               // the calls made outside any other

thread_local int t_depth = 0;  // profiled calls this thread is inside
thread_local Device t_device;  // the device of this thread's last lookup

// A thread's number in events: the order threads first recorded one.
int thread_number() {
  static std::atomic<int> next{0};
  thread_local const int mine = next.fetch_add(1);
  return mine;
}

// "engine.binary:mul": a row's and an event's name.
std::string name_of(const EntryCounter& c) {
  return std::string(c.seam) + "." + c.entry + (c.op ? std::string(":") + c.op : "");
}

struct RawEvent {
  const EntryCounter* counter;
  std::chrono::steady_clock::time_point start;
  int64_t nanos;
  int thread;
};

}  // namespace

// The events of one CallProfile made with `events`, filled while it runs.
struct Recorder {
  std::mutex mutex;
  std::vector<RawEvent> events;
};

namespace {

struct Recorders {
  std::atomic<int> count{0};  // recorders listed: the fast check on every call
  std::mutex mutex;
  std::vector<std::shared_ptr<Recorder>> list;
};
Recorders& recorders() {
  static Recorders* r = new Recorders;  // never destroyed, as the registry
  return *r;
}

}  // namespace

void record_event(const EntryCounter& c, std::chrono::steady_clock::time_point start, int64_t ns) {
  Recorders& rs = recorders();
  if (rs.count.load(std::memory_order_relaxed) == 0) return;
  const RawEvent e{&c, start, ns, thread_number()};
  std::lock_guard<std::mutex> lock(rs.mutex);
  for (const std::shared_ptr<Recorder>& r : rs.list) {
    std::lock_guard<std::mutex> inner(r->mutex);
    r->events.push_back(e);
  }
}

bool active() { return g_profiles.load(std::memory_order_relaxed) > 0; }

void enlist(EntryCounter& c, DeviceType device, const char* seam, const char* entry,
            const char* op) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (c.listed.load(std::memory_order_relaxed)) return;
  c.device = device;
  c.seam = seam;
  c.entry = entry;
  c.op = op;
  r.counters.push_back(&c);
  c.listed.store(true, std::memory_order_release);
}

void note_device(Device device) { t_device = device; }

CallTimer::CallTimer() : start_(std::chrono::steady_clock::now()), outermost_(t_depth == 0) {
  ++t_depth;
}

CallTimer::~CallTimer() { --t_depth; }

void CallTimer::finish(EntryCounter& c, bool wait) {
  // Only the outermost call waits: it holds the inner ones' work.
  if (wait && outermost_ && g_device_profiles.load(std::memory_order_relaxed) > 0 &&
      !t_device.is_cpu() && !capturing(t_device)) {
    const DeviceBackend& b = detail::unprofiled_device_backend(t_device.type);
    if (b.synchronize) b.synchronize(t_device.index);
  }
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start_)
                         .count();
  c.calls.fetch_add(1, std::memory_order_relaxed);
  c.nanos.fetch_add(ns, std::memory_order_relaxed);
  record_event(c, start_, ns);
  if (outermost_) {
    g_outermost.calls.fetch_add(1, std::memory_order_relaxed);
    g_outermost.nanos.fetch_add(ns, std::memory_order_relaxed);
  }
}

SideCall& SideCall::operator=(SideCall&& o) noexcept {
  if (this != &o) {
    this->~SideCall();
    c_ = o.c_;
    start_ = o.start_;
    o.c_ = nullptr;
  }
  return *this;
}

SideCall::~SideCall() {
  if (!c_) return;
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start_)
                         .count();
  c_->calls.fetch_add(1, std::memory_order_relaxed);
  c_->nanos.fetch_add(ns, std::memory_order_relaxed);
  record_event(*c_, start_, ns);
}

}  // namespace profile

struct CallProfile::Snapshot {
  std::map<const profile::EntryCounter*, std::pair<int64_t, int64_t>> entries;  // calls, ns
  int64_t calls = 0, nanos = 0;                                                 // outermost

  static std::unique_ptr<Snapshot> take() {
    auto s = std::make_unique<Snapshot>();
    profile::Registry& r = profile::registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const profile::EntryCounter* c : r.counters)
      s->entries[c] = {c->calls.load(std::memory_order_relaxed),
                       c->nanos.load(std::memory_order_relaxed)};
    s->calls = profile::g_outermost.calls.load(std::memory_order_relaxed);
    s->nanos = profile::g_outermost.nanos.load(std::memory_order_relaxed);
    return s;
  }
};

struct CallProfile::Recording {
  std::shared_ptr<profile::Recorder> recorder = std::make_shared<profile::Recorder>();
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};

namespace {

// Adds or removes a profile's recorder from those record_event fills.
void list_recorder(const std::shared_ptr<profile::Recorder>& r, bool on) {
  profile::Recorders& rs = profile::recorders();
  std::lock_guard<std::mutex> lock(rs.mutex);
  if (on) {
    rs.list.push_back(r);
  } else {
    rs.list.erase(std::remove(rs.list.begin(), rs.list.end(), r), rs.list.end());
  }
  rs.count.store(static_cast<int>(rs.list.size()), std::memory_order_relaxed);
}

}  // namespace

CallProfile::CallProfile(CallTiming timing, bool events) : timing_(timing) {
  if (events) {
    recording_ = std::make_shared<Recording>();
    list_recorder(recording_->recorder, true);
  }
  start_ = Snapshot::take();
  if (timing_ == CallTiming::device) profile::g_device_profiles.fetch_add(1);
  profile::g_profiles.fetch_add(1);
}

CallProfile::~CallProfile() { stop(); }

void CallProfile::stop() {
  if (!running_) return;
  end_ = Snapshot::take();
  if (recording_) list_recorder(recording_->recorder, false);
  profile::g_profiles.fetch_sub(1);
  if (timing_ == CallTiming::device) profile::g_device_profiles.fetch_sub(1);
  running_ = false;
}

std::vector<CallProfileRow> CallProfile::rows() const {
  const std::unique_ptr<Snapshot> now = running_ ? Snapshot::take() : nullptr;
  const Snapshot& end = running_ ? *now : *end_;
  std::vector<CallProfileRow> out;
  for (const auto& [c, counts] : end.entries) {
    const auto before = start_->entries.find(c);
    const std::pair<int64_t, int64_t> from =
        before == start_->entries.end() ? std::pair<int64_t, int64_t>{0, 0} : before->second;
    const int64_t calls = counts.first - from.first;
    if (calls <= 0) continue;
    out.push_back({profile::name_of(*c), c->device, calls,
                   static_cast<double>(counts.second - from.second) * 1e-9});
  }
  std::sort(out.begin(), out.end(), [](const CallProfileRow& a, const CallProfileRow& b) {
    if (a.seconds != b.seconds) return a.seconds > b.seconds;
    return a.name != b.name ? a.name < b.name : a.device < b.device;
  });
  return out;
}

int64_t CallProfile::calls() const {
  const int64_t end = running_ ? profile::g_outermost.calls.load() : end_->calls;
  return end - start_->calls;
}

double CallProfile::seconds() const {
  const int64_t end = running_ ? profile::g_outermost.nanos.load() : end_->nanos;
  return static_cast<double>(end - start_->nanos) * 1e-9;
}

std::vector<CallEvent> CallProfile::events() const {
  std::vector<CallEvent> out;
  if (!recording_) return out;
  std::lock_guard<std::mutex> lock(recording_->recorder->mutex);
  out.reserve(recording_->recorder->events.size());
  for (const profile::RawEvent& e : recording_->recorder->events) {
    out.push_back({profile::name_of(*e.counter), e.counter->device,
                   std::chrono::duration<double>(e.start - recording_->start).count(),
                   static_cast<double>(e.nanos) * 1e-9, e.thread});
  }
  return out;
}

}  // namespace quanta
