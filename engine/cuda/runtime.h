#pragma once
// The CUDA runtime seam: memory and copies, forwarded to libquanta_cuda
// (engine/cuda/module.cpp); without it each throws naming the op and why.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "engine/cuda/module.h"
#include "engine/device.h"

namespace quanta::cuda {

/** Allocates device memory on GPU `device`; throws on failure. */
void* device_malloc(std::size_t nbytes, int device);
/** Returns memory from device_malloc. Never throws. */
void device_free(void* ptr, int device) noexcept;
/** Makes GPU `device` current for this thread's kernel launches; throws
 * naming the device when it is not available. */
void set_device(int device);
/** Copies host<->device or device<->device, in order with the kernels on
 * the device's stream. Uploads of up to 4 MiB are queued: copied into a
 * pinned ring (engine/cuda/upload_ring.h), they return at once with the
 * host's source free to reuse, and whatever runs after them on the device
 * sees the bytes. Every other copy is synchronous; host<->device copies of
 * 16 MiB and more from or into pageable host memory go through pinned
 * staging buffers in 4 MiB chunks (engine/cuda/staging.h). */
void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t nbytes);

/** Waits until everything queued on GPU `device` (kernels, copies) is done;
 * throws the first error a kernel left. For timing and tests: ops need no
 * synchronisation, they are ordered on the device's stream. */
void synchronize(int device);

/** A point in GPU `device`'s default stream: a CUDA event (cudaEvent_t)
 * recorded after everything queued there so far, destroyed with the last
 * copy of the pointer. Other streams wait for it (cudaStreamWaitEvent) to
 * start after that work and not after work queued later. */
std::shared_ptr<void> record_event(int device);

/** How many convolutions the GPUs have run through cuDNN and through im2col
 * + cuBLAS so far (engine/cuda/module.h's ConvPaths): a test or benchmark
 * reads it before and after to see which path ran. */
ConvPaths conv_paths();

/** Lets cuDNN choose nondeterministic convolution algorithms on every GPU
 * (off by default): each convolution's algorithm is then the fastest cuDNN
 * times on the GPU, atomics-based gradients included, and results vary in
 * their last bits from run to run. Applies to convolutions first seen after
 * the call (plans are kept per setting). */
void set_nondeterministic_conv(bool allowed);

/** Graphs on GPU `device` (engine/capture/device_graph.h): begin_capture
 * opens a private pool of the caching allocator and starts capturing the
 * device's stream; end_capture closes both and returns the graph (throws
 * naming what broke the capture); the graph's pool is released with it. */
void begin_capture(int device);
void* end_capture(int device);
void launch_graph(void* graph, int device);
int64_t graph_nodes(const void* graph);
void destroy_graph(void* graph) noexcept;

/** Zeroed pinned host memory that kernels on every GPU may write and the
 * host reads after a synchronising copy (error flags); never freed. */
void* mapped_host_alloc(std::size_t nbytes);

}  // namespace quanta::cuda
