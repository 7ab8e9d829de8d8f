#pragma once
// What a test device's allocator holds, in the units it counts: sim counts
// each tensor's bytes exactly, CUDA's caching allocator the size class each
// block was rounded up to (at least 512 bytes). A test that compares a
// device's bytes with tensors' sizes turns those sizes into the same units
// with counted(), so a model of small tensors reads the same on both.
#include <cstdint>

#include "engine/cuda/caching_allocator.h"
#include "engine/device.h"

namespace quanta::testing {

class DeviceMemory {
 public:
  explicit DeviceMemory(Device dev) : dev_(dev) {}

  /** Bytes the device's tensors hold now. */
  int64_t held() const {
    if (dev_.is_sim()) return device_stats(dev_).allocated_bytes;
    return int64_t(cuda_memory_stats(dev_.index).allocated_bytes);
  }
  /** The most held() was since the last reset_peak(). */
  int64_t peak() const {
    if (dev_.is_sim()) return device_stats(dev_).peak_allocated_bytes;
    return int64_t(cuda_memory_stats(dev_.index).peak_allocated_bytes);
  }
  void reset_peak() const {
    if (dev_.is_sim())
      reset_device_stats(dev_);
    else
      cuda_reset_peak_memory_stats(dev_.index);
  }
  /** What holding a tensor of nbytes adds to held(). */
  int64_t counted(int64_t nbytes) const {
    if (dev_.is_sim() || nbytes == 0) return nbytes;
    return int64_t(cuda::CachingAllocator::size_class(std::size_t(nbytes)));
  }

 private:
  Device dev_;
};

}  // namespace quanta::testing
