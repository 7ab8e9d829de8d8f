#pragma once
// The one stream per GPU that every quanta kernel, copy, library call
// (cuBLAS, cuDNN, CUB) and NCCL join runs on, in the CUDA module. Not the
// legacy default stream (stream 0): that stream cannot be captured into a
// graph (engine/capture/device_graph.h). It is a blocking stream, so work
// that still reaches stream 0 (cudaMemcpy, a library's default) stays in
// order with it outside a capture, and fails a capture loudly inside one.
// One stream keeps the caching allocator's reuse rule: a block freed after
// the kernels that used it is reused by kernels queued after them.
#include <cuda_runtime.h>

namespace quanta::cuda {

/** GPU `device`'s stream, made at its first use and never destroyed. */
cudaStream_t stream_of(int device);
/** The current device's stream (the kernel launches' and copies'). */
cudaStream_t stream();
/** Whether GPU `device`'s stream is being captured into a graph now (where
 * nothing may allocate with cudaFree's wait or run work to time it). */
bool capturing(int device);

}  // namespace quanta::cuda
