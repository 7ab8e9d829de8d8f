#pragma once
// 2-d convolutions with PyTorch's shapes and argument order, computed as
// im2col + GEMM (col2im for the adjoint). f32/f64 compute as they are,
// bf16/f16 in f32; mixed dtypes promote; integer operands are refused.
// Under MixedPrecision (engine/precision.h) f32 convolutions round their
// operands to bf16 where the device multiplies bf16 faster (TF32 on CUDA).
#include <array>
#include <cstdint>

#include "engine/tensor.h"

namespace quanta {

/** How a convolution's activations are stored. nchw: [N, C, H, W], PyTorch's
 * default. nhwc: [N, H, W, C] (PyTorch's channels_last), what the CPU
 * kernels compute in: a model that keeps its activations channels last
 * between layers (element-wise layers do not care) saves two transposes per
 * layer and pass. The weight is [O, C / groups, kh, kw] in both. */
enum class ConvLayout : uint8_t { nchw, nhwc };

/** Cross-correlation of x [N, C, H, W] with w [O, C / groups, kh, kw] plus
 * b [O] (undefined: no bias); returns [N, O, OH, OW] with
 * OH = (H + 2 padding - dilation (kh - 1) - 1) / stride + 1 (same for W).
 * With `layout` nhwc, x is [N, H, W, C] and the result [N, OH, OW, O]. */
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b = Tensor(),
              std::array<int64_t, 2> stride = {1, 1}, std::array<int64_t, 2> padding = {0, 0},
              std::array<int64_t, 2> dilation = {1, 1}, int64_t groups = 1,
              ConvLayout layout = ConvLayout::nchw);

/** Transposed convolution (the adjoint of conv2d) of x [N, C, H, W] with
 * w [C, O / groups, kh, kw] plus b [O]; returns [N, O, OH, OW] with
 * OH = (H - 1) stride - 2 padding + dilation (kh - 1) + output_padding + 1.
 * output_padding must be smaller than stride or dilation. With `layout` nhwc,
 * x is [N, H, W, C] and the result [N, OH, OW, O]. */
Tensor conv_transpose2d(const Tensor& x, const Tensor& w, const Tensor& b = Tensor(),
                        std::array<int64_t, 2> stride = {1, 1},
                        std::array<int64_t, 2> padding = {0, 0},
                        std::array<int64_t, 2> output_padding = {0, 0}, int64_t groups = 1,
                        std::array<int64_t, 2> dilation = {1, 1},
                        ConvLayout layout = ConvLayout::nchw);

}  // namespace quanta
