#pragma once
// Direct ("implicit GEMM") convolution kernels for f32 on AVX-512: the
// channels-last path (conv_channels_last.cpp) hands them a chunk of NHWC
// images, and they multiply straight out of the images, one register tile of
// output at a time, instead of copying the chunk into im2col columns and
// calling a GEMM. The main job's layers have 16 or 32 channels on one side,
// exactly one or two AVX-512 vectors: a GEMM library packs such skinny
// operands for every call and runs them at 35-45% of the FMA peak
// (docs/performance.md), while a tile of 8 pixels x 32 channels lives in 16
// registers for the whole sum over taps and channels.
//
// Each forward output is one sum in a fixed order (taps, then channels), so
// it does not depend on the thread count; the input gradient adds its tiles'
// shares in tile order, and the weight gradient sums a chunk's pixels in
// order, so those follow the chunks (and so the threads). The kernels need AVX-512F at run time
// (checked by conv_direct_serves); the file is compiled for it on its own so
// that -Dnative=false builds keep running on any x86-64.
#include <cstdint>

#include "engine/kernels/conv_geom.h"

namespace quanta::cpu {

/** Whether the direct kernels run `kind` of `g` on this machine: AVX-512F
 * present, one group, and the side held in vectors a multiple of 16: O for
 * forward and weight_grad, C for input_grad. The weight gradient also needs C
 * a multiple of 8 (its tiles are 8 channels of one tap tall; with one
 * channel the GEMM path was faster). */
bool conv_direct_serves(ConvKind kind, const ConvGeom& g);

/** Turns the direct kernels on (the default) or off process-wide; off, every
 * convolution takes the im2col + GEMM paths. For tests and A/B timings. */
void conv_direct_enable(bool on);

/** Where each output pixel's taps land: pixel[l * kh kw + t] is the input
 * pixel (ih * W + iw) that tap t of output position l reads, or -1 in the
 * padding. One table serves every image of the geometry. */
struct TapTable {
  const int32_t* pixel;
};

/** y [nb L, O] = the convolution of nb NHWC images x [nb, H W, C] with
 * wt [kh kw, C, O] (the weight with taps outer, then channels, then outputs).
 * `zeros` holds at least C zeros (the padding's pixel). */
void conv_direct_forward(const float* x, int64_t nb, const ConvGeom& g, TapTable taps,
                         const float* wt, const float* zeros, float* y);

/** gx [nb, H W, C] += the input gradient of nb images' output gradients
 * gy [nb L, O], with wi [kh kw, O, C] (taps, then outputs, then channels). */
void conv_direct_input_grad(const float* gy, int64_t nb, const ConvGeom& g, TapTable taps,
                            const float* wi, float* gx);

/** gw [kh kw, C, O] += the weight gradient of nb NHWC images x and their
 * output gradients gy [nb L, O]. `zeros` as for the forward. */
void conv_direct_weight_grad(const float* x, const float* gy, int64_t nb, const ConvGeom& g,
                             TapTable taps, const float* zeros, float* gw);

}  // namespace quanta::cpu
