#pragma once
// Errors a device finds while it runs, without stopping the host: an index
// out of range. The host cannot check a device's indices without reading
// them (a host sync per index op), so the device checks them itself: the
// kernel records the first bad one in the device's error flag and replaces
// it by 0 so nothing reads out of bounds, and the next host read of that
// device reports it as a clear error naming the op (PyTorch's device-side
// assertions do the same, minus the op). The CPU checks on the host, at once.
#include <cstdint>

#include "engine/device.h"

namespace quanta {

/** What a device's kernels write on an error: memory the device writes and
 * the host reads once a copy from that device has completed. */
struct DeviceErrorFlag {
  int32_t raised = 0;  // 0: none yet; the first error sets 1 (later ones are dropped)
  int32_t check = 0;   // the register_index_check id of the check that raised it
  int64_t value = 0;   // the offending index
};

namespace detail {

/** An index check of `op` (indices along `dim`, of size `size`) about to be
 * queued on a device: returns the id its kernel records on an error. `op`
 * must outlive the process (a string literal). */
int32_t register_index_check(const char* op, int64_t dim, int64_t size);

/** The error flag of `device` (never the CPU): device-writable, host-readable. */
DeviceErrorFlag* device_error_flag(Device device);

/** Called after every completed host read of `device`: throws
 * std::invalid_argument for the error its kernels recorded since the last
 * report, if any, and clears the flag. */
void report_device_errors(Device device);

}  // namespace detail
}  // namespace quanta
