// The host side of device error flags: which op each check id belongs to,
// and the report at the next host read.
#include "engine/device_error.h"

#include <array>
#include <mutex>
#include <stdexcept>
#include <string>

#include "engine/device_backend.h"

namespace quanta::detail {
namespace {

struct IndexCheck {
  int32_t id = -1;
  const char* op = nullptr;
  int64_t dim = 0, size = 0;
};

// The last kChecks checks of the process, by id modulo kChecks: an error is
// reported at the next host read, long before that many index ops queue up
// (if they ever do, the report says so instead of naming the op).
constexpr int32_t kChecks = 4096;

struct Registry {
  std::mutex mutex;
  int32_t next = 1;
  std::array<IndexCheck, kChecks> recent{};
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: tensors die after main's statics
  return *r;
}

}  // namespace

int32_t register_index_check(const char* op, int64_t dim, int64_t size) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int32_t id = r.next;
  r.next = r.next == INT32_MAX ? 1 : r.next + 1;
  r.recent[static_cast<std::size_t>(id % kChecks)] = {id, op, dim, size};
  return id;
}

DeviceErrorFlag* device_error_flag(Device device) {
  const DeviceBackend& b = device_backend(device.type);
  if (!b.error_flag)
    throw std::logic_error(std::string("[device_error_flag] ") + b.name + " has no error flag");
  return b.error_flag(device.index);
}

void report_device_errors(Device device) {
  const DeviceBackend& b = device_backend(device.type);
  if (!b.error_flag) return;
  DeviceErrorFlag* flag = b.error_flag(device.index);
  if (!flag || flag->raised == 0) return;
  const DeviceErrorFlag seen = *flag;
  *flag = DeviceErrorFlag{};
  IndexCheck check;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    check = r.recent[static_cast<std::size_t>(seen.check % kChecks)];
  }
  const std::string where =
      " (found on " + device.str() + " by the kernel, reported at the next read of that device)";
  if (check.id != seen.check || !check.op)
    throw std::invalid_argument("[index op] index " + std::to_string(seen.value) +
                                " was out of bounds in an index op more than " +
                                std::to_string(kChecks) + " index ops ago" + where);
  throw std::invalid_argument(std::string("[") + check.op + "] index " +
                              std::to_string(seen.value) + " is out of bounds for dim " +
                              std::to_string(check.dim) + " with size " +
                              std::to_string(check.size) + where);
}

}  // namespace quanta::detail
