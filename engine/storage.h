#pragma once
// A ref-counted byte buffer on one device. Tensors and their views share it.
#include <cstddef>
#include <memory>

#include "engine/device.h"

namespace quanta {

class Storage {
 public:
  /** Allocates `nbytes` (uninitialised) on `device`. */
  Storage(std::size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  /** Marks the buffer as one that every holder only reads (a shared
   * constant: constant_tensor, shared_full): in-place ops refuse it. */
  void mark_shared_constant() { shared_constant_ = true; }
  bool shared_constant() const { return shared_constant_; }

 private:
  void* data_ = nullptr;
  std::size_t nbytes_ = 0;
  Device device_;
  bool shared_constant_ = false;
};

/** Copies `nbytes` between two buffers on any pair of devices. */
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                std::size_t nbytes);

}  // namespace quanta
