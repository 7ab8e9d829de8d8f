#pragma once
// Host syncs: the points where the host waits for a device (a device-to-host
// copy: item(), to_vector(), to(cpu), printing, a bounds check that reads
// indices back). A training step that has none can run ahead of the GPU and
// can be captured as a graph; these make a stray one fail loudly, on a GPU
// and on the `sim` device alike (device_stats counts them either way).
#include <string>

namespace quanta {

/** Within its scope (on this thread), a host sync throws std::logic_error
 * naming the device, the bytes, `what` and the callers (the op first, then
 * whoever called it), before anything is copied.
 * Guards nest. */
class HostSyncGuard {
 public:
  explicit HostSyncGuard(std::string what = "a HostSyncGuard");
  ~HostSyncGuard();
  HostSyncGuard(const HostSyncGuard&) = delete;
  HostSyncGuard& operator=(const HostSyncGuard&) = delete;
};

/** What a host sync does outside any guard, from QUANTA_HOST_SYNC read once
 * per process: unset or "allow" (nothing), "warn" (prints each distinct
 * call stack once to stderr, with its callers), "error" (throws as a guard would). */
enum class HostSyncPolicy { allow, warn, error };
HostSyncPolicy host_sync_policy();

}  // namespace quanta
