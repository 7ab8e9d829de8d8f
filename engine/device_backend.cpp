// device_backend(): the one place a device type picks its table; the
// counters behind device_stats and the host-sync rules (engine/host_sync.h).
#include "engine/device_backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/call_site.h"
#include "engine/capture/device_graph.h"
#include "engine/device_error.h"
#include "engine/host_sync.h"
#include "engine/profile/timed_table.h"

namespace quanta {

namespace cpu {
const DeviceBackend& host_backend();
}
namespace cuda {
const DeviceBackend& backend();
}
namespace sim {
const DeviceBackend& backend();
}

namespace detail {

const DeviceBackend& unprofiled_device_backend(DeviceType type) {
  switch (type) {
    case DeviceType::cpu:
      return cpu::host_backend();
    case DeviceType::cuda:
      return cuda::backend();
    case DeviceType::sim:
      return sim::backend();
  }
  throw std::logic_error("[device_backend] unknown device type");
}

}  // namespace detail

// While a CallProfile lives, a copy whose memory, copies and waits are
// counted as "device.*" (engine/profile/call_profile.h).
const DeviceBackend& device_backend(DeviceType type) {
  return profile::lookup(detail::unprofiled_device_backend(type), type, "device",
                         [](auto d, DeviceBackend& t, const DeviceBackend& s, const char* seam) {
                           QUANTA_TIME_DEVICE_ENTRY(allocate)
                           QUANTA_TIME_DEVICE_ENTRY(release)
                           QUANTA_TIME_DEVICE_ENTRY(copy)
                           QUANTA_TIME_DEVICE_ENTRY(synchronize)
                         });
}

void synchronize(Device device) {
  if (capturing(device))
    throw std::logic_error("[synchronize] inside a captured step on " + device.str() +
                           ": its work runs at replay; synchronize after replay()");
  const DeviceBackend& b = device_backend(device.type);
  if (!b.synchronize) return;
  b.synchronize(device.index);
  detail::report_device_errors(device);  // what the finished kernels found
}

namespace {

struct Counters {
  std::mutex mutex;
  std::map<std::pair<int, int>, DeviceStats> stats;  // (type, index)
  std::set<std::vector<void*>> warned;               // call stacks already printed
  int64_t total_syncs = 0;
};
Counters& counters() {
  static Counters* c = new Counters;  // never destroyed: tensors die after main's statics
  return *c;
}
DeviceStats& slot(Counters& c, Device d) { return c.stats[{static_cast<int>(d.type), d.index}]; }

// The open guards of this thread, innermost last.
thread_local std::vector<std::string> guards;
}  // namespace

HostSyncPolicy host_sync_policy() {
  static const HostSyncPolicy p = [] {
    const char* v = std::getenv("QUANTA_HOST_SYNC");
    const std::string s = v ? v : "";
    if (s.empty() || s == "allow") return HostSyncPolicy::allow;
    if (s == "warn") return HostSyncPolicy::warn;
    if (s == "error") return HostSyncPolicy::error;
    std::fprintf(stderr, "quanta: QUANTA_HOST_SYNC=%s is not allow, warn or error; ignored\n",
                 s.c_str());
    return HostSyncPolicy::allow;
  }();
  return p;
}

HostSyncGuard::HostSyncGuard(std::string what) { guards.push_back(std::move(what)); }
HostSyncGuard::~HostSyncGuard() { guards.pop_back(); }

namespace detail {

void count_copy(Device dst, Device src, std::size_t nbytes) {
  if (dst.is_cpu() && src.is_cpu()) return;  // nothing to count: keep CPU copies lock-free
  const bool to_host = dst.is_cpu() && !src.is_cpu();
  if (src.is_cpu() && capturing(dst))
    throw std::logic_error(
        "[copy] " + std::to_string(nbytes) + " bytes from the host to " + dst.str() +
        " inside a captured step: every replay would copy the bytes the host had at capture; "
        "copy the step's inputs into the tensors it reads before each replay" +
        describe_call_stack(call_stack(1, 24), 6));
  if (to_host) {
    const HostSyncPolicy policy = !guards.empty() ? HostSyncPolicy::error : host_sync_policy();
    if (policy != HostSyncPolicy::allow) {
      // The callers say which op read the device and who asked for it.
      const std::vector<void*> stack = call_stack(1, 24);
      std::string m = "[host sync] a copy of " + std::to_string(nbytes) + " bytes from " +
                      src.str() + " to the host";
      if (policy == HostSyncPolicy::error) {
        m += !guards.empty() ? " inside " + guards.back()
                             : std::string(" while QUANTA_HOST_SYNC=error");
        m += " (item(), to_vector(), to(cpu), printing and index bounds checks read the device)";
        throw std::logic_error(m + describe_call_stack(stack, 6));
      }
      Counters& c = counters();
      std::lock_guard<std::mutex> lock(c.mutex);
      if (c.warned.insert(stack).second)
        std::fprintf(stderr, "quanta: %s%s\n", m.c_str(), describe_call_stack(stack, 6).c_str());
    }
  }
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  const auto n = static_cast<int64_t>(nbytes);
  if (to_host) {
    ++c.total_syncs;
    DeviceStats& s = slot(c, src);
    ++s.host_syncs;
    ++s.copies_to_host;
    s.bytes_to_host += n;
  } else if (src.is_cpu() && !dst.is_cpu()) {
    DeviceStats& s = slot(c, dst);
    ++s.copies_from_host;
    s.bytes_from_host += n;
  } else if (!src.is_cpu()) {
    ++slot(c, src).copies_on_device;
    if (dst != src) ++slot(c, dst).copies_on_device;
  }
}

void count_allocation(Device device, std::size_t nbytes, bool taken) {
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  DeviceStats& s = slot(c, device);
  const auto n = static_cast<int64_t>(nbytes);
  if (taken) {
    ++s.allocations;
    s.allocated_bytes += n;
    if (s.allocated_bytes > s.peak_allocated_bytes) s.peak_allocated_bytes = s.allocated_bytes;
  } else {
    s.allocated_bytes -= n;
  }
}

}  // namespace detail

DeviceStats device_stats(Device device) {
  if (device.is_cpu()) return {};
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return slot(c, device);
}

int64_t host_sync_count() {
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.total_syncs;
}

void reset_device_stats(Device device) {
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  DeviceStats& s = slot(c, device);
  const int64_t live = s.allocated_bytes;
  s = DeviceStats{};
  s.allocated_bytes = live;
  s.peak_allocated_bytes = live;
}

}  // namespace quanta
