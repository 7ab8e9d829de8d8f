#pragma once
// A cuBLAS handle as every quanta GEMM on a GPU uses it: default math (no
// TF32 unless a call asks for it), on the device's quanta stream
// (engine/cuda/stream.h), with a workspace of its own, so that a GEMM inside
// a captured graph allocates nothing (cuBLAS would otherwise take memory
// from its own pool while the stream is being captured).
#include <cublas_v2.h>

namespace quanta::cuda {

/** A new handle for GPU `device` (current on entry), set up as above;
 * never destroyed (at exit the runtime may be gone). */
cublasHandle_t new_blas_handle(int device);

}  // namespace quanta::cuda
