#pragma once
// The one oneDNN CPU engine the process uses (bf16 products, convolutions),
// for builds with oneDNN (QUANTA_GEMM_ONEDNN). oneDNN threads its primitives
// on OpenMP as quanta does when the build's oneDNN runs on OpenMP; one on
// another runtime would start threads of its own beside quanta's, so the
// callers take oneDNN's primitives only when onednn_on_openmp().
#ifdef QUANTA_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>

namespace quanta::cpu {

/** oneDNN's CPU engine, made on first use. */
dnnl::engine& onednn_engine();

/** A stream on onednn_engine() for the calling thread. */
dnnl::stream& onednn_stream();

/** True when the build's oneDNN threads on OpenMP. */
bool onednn_on_openmp();

}  // namespace quanta::cpu
#endif
