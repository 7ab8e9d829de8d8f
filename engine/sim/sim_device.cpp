// The `sim` device's table: a GPU stand-in that every machine has. Its memory
// is host memory of its own (aligned like the CPU's, so the CPU's kernels run
// on it and give the CPU's bits), counted in device_stats; its copies are
// memcpy, counted too (copy_bytes counts them for every device). What makes
// it a GPU from the host's side lives elsewhere, unchanged for it: tensors of
// two devices refuse to meet in an op (common_device), Tensor::data<T> refuses
// a device tensor, and every read from the host is a device-to-host copy,
// a host sync that a HostSyncGuard can forbid. Kernels check indices as a
// GPU's do: into the error flag, reported at the next read.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

#include "engine/device_backend.h"
#include "engine/device_error.h"

namespace quanta::sim {
namespace {

constexpr std::size_t kAlignment = 64;

void* allocate(std::size_t nbytes, int index) {
  const std::size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) throw std::bad_alloc();
  detail::count_allocation(Device::sim(index), nbytes, true);
  return p;
}

void release(void* p, std::size_t nbytes, int index) noexcept {
  detail::count_allocation(Device::sim(index), nbytes, false);
  std::free(p);
}

void copy(void* dst, Device, const void* src, Device, std::size_t nbytes) {
  std::memcpy(dst, src, nbytes);
}

// One flag per device index, in host memory as all of sim's is.
DeviceErrorFlag* error_flag(int index) {
  static std::mutex mutex;
  static std::map<int, DeviceErrorFlag>* flags = new std::map<int, DeviceErrorFlag>;
  std::lock_guard<std::mutex> lock(mutex);
  return &(*flags)[index];
}

}  // namespace

const DeviceBackend& backend() {
  // The CPU's kernel table, so its layouts: the results are the CPU's bits.
  // add_n's fused loop is host code in the op (it reads data<T>), so sim
  // takes the chain of adds, which sums the terms in the same order.
  static const DeviceBackend b{
      .name = "sim",
      .caps = {.channels_last_conv = true, .fused_add_n = false, .host_readable = false},
      .allocate = allocate,
      .release = release,
      .copy = copy,
      .error_flag = error_flag,
  };
  return b;
}

}  // namespace quanta::sim
