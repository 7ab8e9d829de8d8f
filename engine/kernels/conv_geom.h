#pragma once
// The geometry the kernel table's convolution and pooling entries take: plain
// structs of sizes and window parameters, filled in (and validated) by
// engine/ops/conv.cpp and engine/ops/pool.cpp.
#include <array>
#include <cstdint>
#include <string>

namespace quanta {

/** Sizes of one convolution, always seen from the conv2d side:
 * input [N, C, H, W], weight [O, C / groups, kh, kw], output [N, O, OH, OW].
 * conv_transpose2d is the input gradient of the conv2d with these sizes.
 * With `channels_last` the activations (input, output and their gradients)
 * are stored [N, H, W, C] and [N, OH, OW, O] instead; the weight never
 * changes layout. Kernels take channels_last only with one group (the op
 * layer converts the rest). */
struct ConvGeom {
  using Pair = std::array<int64_t, 2>;
  int64_t N, C, H, W;
  int64_t O, kh, kw;
  int64_t OH, OW;
  Pair stride, padding, dilation;
  int64_t groups;
  bool channels_last = false;
  /** f32 convolutions may round their operands to bf16 (f32 sums and
   * result): MixedPrecision's (engine/precision.h). */
  bool bf16_products = false;

  int64_t cg() const { return C / groups; }
  int64_t og() const { return O / groups; }
  int64_t ckk() const { return cg() * kh * kw; }  // rows of one group's columns
  int64_t L() const { return OH * OW; }           // output positions per image
  // A 1x1 kernel reading every input pixel once: the input is its own im2col.
  bool pointwise() const {
    return kh == 1 && kw == 1 && stride == Pair{1, 1} && padding == Pair{0, 0} && OH == H &&
           OW == W;
  }
};

/** The three kernels of one ConvGeom; each one's backward is the other two. */
enum class ConvKind : uint8_t {
  forward,      // (x, w) -> y [N, O, OH, OW], bias [O]
  input_grad,   // (g, w) -> [N, C, H, W], bias [C]  (= conv_transpose2d)
  weight_grad,  // (x, g) -> [O, C / groups, kh, kw], no bias
};

/** The op a conv kernel serves, for errors. */
constexpr const char* conv_op_name(ConvKind kind) {
  return kind == ConvKind::forward      ? "conv2d"
         : kind == ConvKind::input_grad ? "conv_transpose2d"
                                        : "conv2d_weight_grad";
}

/** "(a, b)": a window parameter as the ops' error messages print it. (Built by
 * appending: GCC 12 warns falsely (-Wrestrict) on "(" + std::string.) */
inline std::string pair_str(const std::array<int64_t, 2>& p) {
  std::string s = "(";
  s += std::to_string(p[0]);
  s += ", ";
  s += std::to_string(p[1]);
  s += ")";
  return s;
}

/** P planes of H x W pooled to OH x OW by kernel windows: window (oh, ow)
 * reads rows oh * stride[0] - padding[0] + i * dilation[0] for i < kernel[0]
 * (columns likewise); positions outside the plane are padding. */
struct PoolWindow {
  using Pair = std::array<int64_t, 2>;
  int64_t P, H, W, OH, OW;
  Pair kernel, stride, padding, dilation;
};

}  // namespace quanta
