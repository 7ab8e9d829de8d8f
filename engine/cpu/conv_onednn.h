#pragma once
// Convolutions through oneDNN's primitives (builds with oneDNN on OpenMP):
// the forward, the input gradient (conv_transpose2d) and the weight
// gradient of f32 layers, with the activations in the layout they are
// stored in (NHWC channels last, NCHW otherwise) and the weight reordered to
// the layout oneDNN's kernel reads. oneDNN's JIT convolutions keep the FMA
// units busier than our own direct kernels on the main job's layers (2 threads
// of a Xeon with AMX: 0.83 against 1.78 ms for enc2's forward and both
// backwards, docs/performance.md), and where MixedPrecision asks for bf16
// products and they pay on this CPU (bf16_gemm_native(): AMX, or AMD's
// AVX512_BF16), they run on the bf16 instructions: the activation, the
// output gradient and the weight rounded to bf16 (round_to_bf16, as every
// bf16 product here), f32 sums and results.
//
// Each geometry's primitive is made once per thread (oneDNN's JIT) and kept;
// a geometry oneDNN would only run through its reference loops, or cannot
// describe, is left to the kernels in conv_kernels.cpp. The forward's sums do
// not depend on the thread count; the weight gradient's split over images
// follows it, as our own kernels' does.
#include <string>

#include "engine/kernels/conv_geom.h"

namespace quanta::cpu {

/** Runs `kind` of `g` through oneDNN when it serves it (see above): a
 * (input, or output gradient), b (weight, or output gradient for the weight
 * gradient), bias (forward: [O]; input gradient: [C]; may be null) into
 * out, as conv() in kernels.h takes them, f32. Returns false, having written
 * nothing, when oneDNN does not serve it (no oneDNN, turned off, reference
 * loops only). g.N > 0. */
bool conv_onednn(ConvKind kind, const ConvGeom& g, const float* a, const float* b,
                 const float* bias, float* out);

/** oneDNN's name for the kernel that runs `kind` of `g` (its implementation
 * string, "brgconv:avx512_core_amx_bf16" say), or "" when conv_onednn would
 * not serve it. For tests and benchmarks. */
std::string conv_onednn_kernel(ConvKind kind, const ConvGeom& g);

/** Turns the oneDNN path on (the default where the build has oneDNN on
 * OpenMP; QUANTA_CPU_ONEDNN_CONV=0 starts it off) or off process-wide; off,
 * every convolution takes our own kernels. Returns whether it was on. For
 * tests and A/B timings. */
bool conv_onednn_enable(bool on);

}  // namespace quanta::cpu
