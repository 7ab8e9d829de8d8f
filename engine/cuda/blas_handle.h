#pragma once
// The cuBLAS handle every quanta product on a GPU uses (the engine's GEMMs,
// the quantizers' and the language models' kernels alike): default math (no
// TF32 unless a call asks for it), on the device's quanta stream
// (engine/cuda/stream.h), with a workspace of its own, so that a GEMM inside
// a captured graph allocates nothing (cuBLAS would otherwise take memory
// from its own pool while the stream is being captured).
#include <cublas_v2.h>

namespace quanta::cuda {

/** The current device's handle, made on its first use (a capture makes it
 * before it starts: making one allocates); never destroyed (at exit the
 * runtime may be gone). */
cublasHandle_t blas_handle();

}  // namespace quanta::cuda
