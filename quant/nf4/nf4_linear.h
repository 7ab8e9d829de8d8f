#pragma once
// Linear layer math with a frozen NF4 weight: y = x W^T + b where W is an nf4
// tensor [out, in] or a bitsandbytes state of any block size (block 32
// included). The weight is dequantized tile by tile into a small buffer
// (never as a whole), or, for a batch of at most 8 rows whose rows start on a
// run of codes (in % 64 == 0; in % 32 == 0 at block 32), decoded on the fly
// while the packed bytes are read once.
#include "engine/tensor.h"
#include "quant/kernels/nf4_layout.h"
#include "quant/nf4/nf4_interop.h"

namespace quanta::quant {

// kNF4FusedMaxBatch (rows up to which the fused decode-and-dot path runs)
// and kNF4TileElems (elements of one dequantized weight tile) live with the
// kernels: quant/kernels/nf4_layout.h.

/** x [..., in] (f32 or f64) times the nf4 weight w [out, in] transposed, plus
 * bias [out] (undefined: none); returns [..., out] in x's dtype, on x's device
 * (which w and bias share; the work is the device's nf4_linear kernel). The weight's
 * values are dequant_dtype(value * scale) (f32, bf16 or f16: bitsandbytes'
 * compute dtype), the products and sums are in x's dtype. Backward gives the
 * gradients of x and bias; the nf4 weight is frozen (nf4 tensors cannot
 * require grad). Inside an UnreadOutputGuard (engine/autograd/grad_mode.h)
 * the result is zeros, the backward the same, unless the product writes
 * the bf16 rounding of x that others share (SharedBf16Input). */
Tensor nf4_linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(),
                  DType dequant_dtype = DType::f32);

/** nf4_linear with a weight in bitsandbytes' layout (shape [out, in], any
 * block size, with or without double quant): equals
 * linear(x, dequantize(w, dequant_dtype), bias). */
Tensor nf4_linear(const Tensor& x, const BnbNF4State& w, const Tensor& bias = Tensor(),
                  DType dequant_dtype = DType::f32);

namespace detail {
/** The bitsandbytes-layout nf4_linear once its scales are built: `packed`
 * (u8, two codes a byte, `shape` [out, in] row-major), `scales` (f32, one per
 * `block` elements; bnb_scales), on x's device. For a layer that keeps its
 * scales (NF4Linear) instead of rebuilding them per call. */
Tensor nf4_linear_scaled(const Tensor& x, const Tensor& packed, const Tensor& scales, int64_t block,
                         const Shape& shape, const Tensor& bias, DType dequant_dtype);
}  // namespace detail

}  // namespace quanta::quant
