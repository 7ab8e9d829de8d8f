#pragma once
// The channels-last path of the CPU's convolution kernels: a chunk of NCHW
// images is transposed to NHWC, so that im2col copies (and col2im adds)
// whole channel vectors instead of single pixels, one GEMM covers the chunk,
// and the result is transposed back. The planar path's im2col moves one
// float at a time on strided layers; with 32 channels this one moves 128
// bytes. Activations already stored channels last (ConvGeom::channels_last)
// are read and written in place, with no transposes.
#include <cstdint>

#include "engine/kernels/conv_geom.h"

namespace quanta::cpu {

/** Whether `g` runs channels last: one group, and enough channels on the
 * side im2col reads (C) for its vectors to beat the transposes. */
bool channels_last_pays(const ConvGeom& g);

/** One kernel of `kind` (forward, input_grad, weight_grad as in conv()) on
 * contiguous operands (NCHW, or NHWC with g.channels_last), channels last inside; `out` is
 * uninitialised. N > 0 (conv() answers an empty batch). `direct`: multiply with the direct kernels
 * (conv_direct.h, f32 only, where conv_direct_serves says so) instead of im2col + GEMM. */
template <class T>
void conv_channels_last(ConvKind kind, const T* a, const T* b, const T* bias, T* out,
                        const ConvGeom& g, bool direct);

}  // namespace quanta::cpu
