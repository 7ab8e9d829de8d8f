#include "engine/storage.h"

#include <cstring>
#include <vector>

#include "engine/device_backend.h"
#include "engine/device_error.h"

namespace quanta {

Storage::Storage(std::size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  if (nbytes == 0) return;  // zero-size tensors own no memory
  data_ = device_backend(device.type).allocate(nbytes, device.index);
}

Storage::~Storage() {
  if (data_) device_backend(device_.type).release(data_, nbytes_, device_.index);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                std::size_t nbytes) {
  if (nbytes == 0) return;
  detail::count_copy(dst_device, src_device, nbytes);
  if (!dst_device.is_cpu() && !src_device.is_cpu() && dst_device.type != src_device.type) {
    // Between two kinds of device (sim and cuda): through the host.
    std::vector<unsigned char> staged(nbytes);
    device_backend(src_device.type).copy(staged.data(), Device::cpu(), src, src_device, nbytes);
    device_backend(dst_device.type).copy(dst, dst_device, staged.data(), Device::cpu(), nbytes);
    return;
  }
  // The device that is not the host does the copy (the CPU's when both are).
  const Device owner = dst_device.is_cpu() ? src_device : dst_device;
  device_backend(owner.type).copy(dst, dst_device, src, src_device, nbytes);
  // The device has run everything queued before this read: what its
  // kernels found wrong is known now.
  if (dst_device.is_cpu() && !src_device.is_cpu()) detail::report_device_errors(src_device);
}

}  // namespace quanta
