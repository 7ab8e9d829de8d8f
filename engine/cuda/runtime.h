#pragma once
// The CUDA runtime seam: memory and copies, forwarded to libquanta_cuda
// (engine/cuda/module.cpp); without it each throws naming the op and why.
#include <cstddef>

#include "engine/device.h"

namespace quanta::cuda {

/** Allocates device memory on GPU `device`; throws on failure. */
void* device_malloc(std::size_t nbytes, int device);
/** Returns memory from device_malloc. Never throws. */
void device_free(void* ptr, int device) noexcept;
/** Makes GPU `device` current for this thread's kernel launches; throws
 * naming the device when it is not available. */
void set_device(int device);
/** Copies host<->device or device<->device; synchronous. */
void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t nbytes);

}  // namespace quanta::cuda
