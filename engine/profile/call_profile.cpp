// CallProfile and the counters behind it: a profile sums, over the spans it
// ran, the differences of every entry's running counts between the span's
// start and end.
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

// The events of one CallProfile made with `events`, filled while it runs;
// their starts count from `start`.
struct Recorder {
  std::mutex mutex;
  std::vector<RawEvent> events;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
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

namespace {

// One finished call that began at `start`, counted in `c` and handed to the
// recorders; returns its nanoseconds.
int64_t count_call(EntryCounter& c, std::chrono::steady_clock::time_point start) {
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  c.calls.fetch_add(1, std::memory_order_relaxed);
  c.nanos.fetch_add(ns, std::memory_order_relaxed);
  record_event(c, start, ns);
  return ns;
}

}  // namespace

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
  const int64_t ns = count_call(c, start_);
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
  if (c_) count_call(*c_, start_);
}

}  // namespace profile

struct CallProfile::Counts {
  std::map<const profile::EntryCounter*, std::pair<int64_t, int64_t>> entries;  // calls, ns
  int64_t calls = 0, nanos = 0;                                                 // outermost

  static std::unique_ptr<Counts> now() {
    auto s = std::make_unique<Counts>();
    profile::Registry& r = profile::registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const profile::EntryCounter* c : r.counters)
      s->entries[c] = {c->calls.load(std::memory_order_relaxed),
                       c->nanos.load(std::memory_order_relaxed)};
    s->calls = profile::g_outermost.calls.load(std::memory_order_relaxed);
    s->nanos = profile::g_outermost.nanos.load(std::memory_order_relaxed);
    return s;
  }

  // Adds what the counters counted from `from` to `to` (a counter enlisted
  // in between started at 0).
  void add_span(const Counts& from, const Counts& to) {
    for (const auto& [c, counts] : to.entries) {
      const auto before = from.entries.find(c);
      auto& sum = entries[c];
      sum.first += counts.first - (before == from.entries.end() ? 0 : before->second.first);
      sum.second += counts.second - (before == from.entries.end() ? 0 : before->second.second);
    }
    calls += to.calls - from.calls;
    nanos += to.nanos - from.nanos;
  }
};

// A Recorder: record_event fills it through the list of recorders.
struct CallProfile::Recording : profile::Recorder {};

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

bool most_time_first(const CallProfileRow& a, const CallProfileRow& b) {
  if (a.seconds != b.seconds) return a.seconds > b.seconds;
  return a.name != b.name ? a.name < b.name : a.device < b.device;
}

CallProfile::CallProfile(CallTiming timing, bool events)
    : timing_(timing), ended_(std::make_unique<Counts>()) {
  if (events) recording_ = std::make_shared<Recording>();
  resume();
}

CallProfile::~CallProfile() { stop(); }

void CallProfile::resume() {
  if (running_) return;
  if (recording_) list_recorder(recording_, true);
  span_start_ = Counts::now();
  if (timing_ == CallTiming::device) profile::g_device_profiles.fetch_add(1);
  profile::g_profiles.fetch_add(1);
  running_ = true;
}

void CallProfile::stop() {
  if (!running_) return;
  ended_->add_span(*span_start_, *Counts::now());
  if (recording_) list_recorder(recording_, false);
  profile::g_profiles.fetch_sub(1);
  if (timing_ == CallTiming::device) profile::g_device_profiles.fetch_sub(1);
  running_ = false;
}

CallProfile::Counts CallProfile::counted() const {
  Counts sum = *ended_;
  if (running_) sum.add_span(*span_start_, *Counts::now());
  return sum;
}

std::vector<CallProfileRow> CallProfile::rows() const {
  std::vector<CallProfileRow> out;
  for (const auto& [c, counts] : counted().entries)
    if (counts.first > 0)
      out.push_back({profile::name_of(*c), c->device, counts.first,
                     static_cast<double>(counts.second) * 1e-9});
  std::sort(out.begin(), out.end(), most_time_first);
  return out;
}

int64_t CallProfile::calls() const { return counted().calls; }

double CallProfile::seconds() const { return static_cast<double>(counted().nanos) * 1e-9; }

std::vector<CallEvent> CallProfile::events() const {
  std::vector<CallEvent> out;
  if (!recording_) return out;
  std::lock_guard<std::mutex> lock(recording_->mutex);
  out.reserve(recording_->events.size());
  for (const profile::RawEvent& e : recording_->events)
    out.push_back({profile::name_of(*e.counter), e.counter->device,
                   std::chrono::duration<double>(e.start - recording_->start).count(),
                   static_cast<double>(e.nanos) * 1e-9, e.thread});
  return out;
}

}  // namespace quanta
