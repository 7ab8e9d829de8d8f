#pragma once
// How a table of function pointers (a kernel seam's or a device's) becomes
// the copy a CallProfile (engine/profile/call_profile.h) sees calls through:
// the same table with each entry replaced by Timed<D, &Table::entry>::call,
// which counts and times the call and makes it. Each seam's one lookup
// hands it out while a profile lives:
//
//   return profile::kernel_lookup(table, device, "engine", [](auto d, KernelTable& t,
//                                                              const KernelTable& s,
//                                                              const char* seam) {
//     QUANTA_KERNEL_ENTRIES(QUANTA_TIME_ENTRY)
//   });
//
// The copy is made once per table type, device type and lookup.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "engine/device.h"

namespace quanta {

struct DeviceBackend;

namespace detail {
/** The device table of `type` itself (device_backend.cpp), never the
 * profiled copy: what a profile's own waits call. */
const DeviceBackend& unprofiled_device_backend(DeviceType type);
}  // namespace detail

namespace profile {

/** One entry's calls and nanoseconds inside them, counted while a profile
 * lives, from the first. Never destroyed (a CallProfile reads it by
 * address). */
struct EntryCounter {
  DeviceType device = DeviceType::cpu;
  const char* seam = nullptr;
  const char* entry = nullptr;
  /** For an entry whose first argument names its op (an elementwise
   * family's UnaryOp, a reduction's RowReduce: whatever op_name() names),
   * the op: each op its own counter, "engine.binary:mul". */
  const char* op = nullptr;
  std::atomic<bool> listed{false};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> nanos{0};
};

/** Whether a CallProfile lives. */
bool active();

/** Makes `c` one of the counters profiles read (once each). */
void enlist(EntryCounter& c, DeviceType device, const char* seam, const char* entry,
            const char* op = nullptr);

// Op counters an entry keeps at most; an op past them counts in the entry's.
inline constexpr std::size_t kNamedOps = 128;

/** Hands one finished call to the profiles that record events: it started
 * at `start` and took `ns` (a no-op when none does). */
void record_event(const EntryCounter& c, std::chrono::steady_clock::time_point start, int64_t ns);

/** Notes that this thread's next kernel calls go to `device` (a lookup's
 * device: the entries take raw pointers). */
void note_device(Device device);

/** One call's timing: made before the call, finish()ed after it returns.
 * `wait`: with CallTiming::device, synchronise the noted device first (a
 * kernel seam's calls; not a device table's, which copy and allocate on the
 * host's orders). A call made inside another is counted, and its time is
 * not added to the outermost calls' total. */
class CallTimer {
 public:
  CallTimer();
  ~CallTimer();
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;
  void finish(EntryCounter& c, bool wait);

 private:
  std::chrono::steady_clock::time_point start_;
  bool outermost_;
};

/** What runs beside the tables' calls (a collective, on whichever thread
 * makes it), timed from construction to destruction into one counter and
 * kept out of the outermost calls' totals: a collective on DataParallel's
 * communication thread overlaps the step's kernels. Inert when made
 * without a counter. */
class SideCall {
 public:
  SideCall() = default;
  explicit SideCall(EntryCounter* c) : c_(c), start_(std::chrono::steady_clock::now()) {}
  SideCall(SideCall&& o) noexcept : c_(o.c_), start_(o.start_) { o.c_ = nullptr; }
  SideCall& operator=(SideCall&& o) noexcept;
  SideCall(const SideCall&) = delete;
  SideCall& operator=(const SideCall&) = delete;
  ~SideCall();

 private:
  EntryCounter* c_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

template <DeviceType D, auto Member, bool Wait>
struct Timed;

/** Entry Member of a table, for device type D: `source` is the device's
 * function it calls (noexcept where the entry is: a device's release). */
template <DeviceType D, typename Table, typename R, typename... A, bool NoThrow,
          R (*Table::*Member)(A...) noexcept(NoThrow), bool Wait>
struct Timed<D, Member, Wait> {
  static inline R (*source)(A...) noexcept(NoThrow) = nullptr;
  static inline EntryCounter counter;
  static R call(A... a) noexcept(NoThrow) {
    if (!active()) return source(std::forward<A>(a)...);
    CallTimer timer;
    EntryCounter& c = counter_for(a...);
    if constexpr (std::is_void_v<R>) {
      source(std::forward<A>(a)...);
      timer.finish(c, Wait);
    } else {
      R r = source(std::forward<A>(a)...);
      timer.finish(c, Wait);
      return r;
    }
  }

 private:
  // The counter of this call: its op's where the first argument is an op
  // that op_name() names (found where the table is looked up), else the
  // entry's.
  template <typename First, typename... Rest>
  static EntryCounter& counter_for(const First& first, const Rest&...) {
    if constexpr (std::is_enum_v<First> && requires { op_name(first); }) {
      static EntryCounter per_op[kNamedOps];
      const auto i = static_cast<std::size_t>(first);
      if (i < kNamedOps) {
        EntryCounter& c = per_op[i];
        if (!c.listed.load(std::memory_order_acquire))
          enlist(c, counter.device, counter.seam, counter.entry, op_name(first));
        return c;
      }
    }
    return counter;
  }
  static EntryCounter& counter_for() { return counter; }
};

/** The timed stand-in for entry Member whose device function is `source`
 * (null stays null: an entry a device leaves empty). */
template <DeviceType D, auto Member, bool Wait, typename Fn>
Fn timed(Fn source, const char* seam, const char* entry) {
  if (!source) return source;
  using T = Timed<D, Member, Wait>;
  T::source = source;
  enlist(T::counter, D, seam, entry);
  return &T::call;
}

/** `table` as it is, or while a profile lives its timed copy for device
 * type `type`: `fill(device type constant, copy, table, seam)` replaces the
 * copy's entries (QUANTA_TIME_ENTRY for each), once per lookup and type. */
template <typename Table, typename Fill>
const Table& lookup(const Table& table, DeviceType type, const char* seam, Fill fill) {
  if (!active()) return table;
  const auto made = [&](auto d) -> const Table& {
    static const Table copy = [&] {
      Table t = table;
      fill(d, t, table, seam);
      return t;
    }();
    return copy;
  };
  switch (type) {
    case DeviceType::cpu:
      return made(std::integral_constant<DeviceType, DeviceType::cpu>{});
    case DeviceType::cuda:
      return made(std::integral_constant<DeviceType, DeviceType::cuda>{});
    case DeviceType::sim:
      return made(std::integral_constant<DeviceType, DeviceType::sim>{});
  }
  return table;
}

/** The same for a kernel seam, whose calls go to `device`: noted, so that
 * CallTiming::device waits for it. */
template <typename Table, typename Fill>
const Table& kernel_lookup(const Table& table, Device device, const char* seam, Fill fill) {
  if (!active()) return table;
  note_device(device);
  return lookup(table, device.type, seam, fill);
}

}  // namespace profile
}  // namespace quanta

/** In a lookup's fill (above): entry `entry` of the copy `t` timed, waiting
 * for the device under CallTiming::device. */
#define QUANTA_TIME_ENTRY(entry)                                                                   \
  t.entry = ::quanta::profile::timed<decltype(d)::value, &std::remove_cvref_t<decltype(t)>::entry, \
                                     true>(s.entry, seam, #entry);

/** The same for a device table's entry, which never waits for the device. */
#define QUANTA_TIME_DEVICE_ENTRY(entry)                                                            \
  t.entry = ::quanta::profile::timed<decltype(d)::value, &std::remove_cvref_t<decltype(t)>::entry, \
                                     false>(s.entry, seam, #entry);
