// conv2d and conv_transpose2d. Three kernels share one geometry: the
// convolution y = conv(x, w), its input gradient (the transposed convolution)
// and its weight gradient. All three are the partial derivatives of one
// trilinear form <conv(x, w), g>, so each one's backward is the other two.
// The kernels are the device table's `conv` entry (engine/cpu/conv_kernels.cpp,
// engine/cuda/conv_kernels.cu); this file validates, sizes and differentiates.
#include "engine/ops/conv.h"

#include <string>

#include "engine/autograd/node.h"
#include "engine/device_backend.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/precision.h"

namespace quanta {
namespace {

using Pair = std::array<int64_t, 2>;

using Kind = ConvKind;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::forward:
      return "conv2d";
    case Kind::input_grad:
      return "conv_transpose2d";
    default:
      return "conv2d_weight_grad";
  }
}

// An activation's shape in the geometry's layout.
Shape activation_shape(const ConvGeom& g, int64_t channels, int64_t h, int64_t w) {
  return g.channels_last ? Shape{g.N, h, w, channels} : Shape{g.N, channels, h, w};
}

Shape out_shape(Kind kind, const ConvGeom& g) {
  switch (kind) {
    case Kind::forward:
      return activation_shape(g, g.O, g.OH, g.OW);
    case Kind::input_grad:
      return activation_shape(g, g.C, g.H, g.W);
    default:
      return {g.O, g.cg(), g.kh, g.kw};
  }
}

// The bias gradient of channels-last activations g [N, H, W, C]: per image,
// a row of ones times its pixels [H W, C] (one pass over the pixels, where
// sum() over {0, 1, 2} would first copy g's transpose), then the images'
// sums. Summing per image keeps the order of the channels-first path's
// (pixels, then images), so a batch split across ranks sums the same.
Tensor channels_last_bias_grad(const Tensor& g) {
  const int64_t n = g.size(0), pixels = g.size(1) * g.size(2), c = g.size(3);
  const Tensor ones_row = shared_full({pixels}, 1.0, options_of(g));
  return sum(matmul(ones_row, reshape(g, {n, pixels, c})), {0});
}

// Channels last <-> channels first, for the kernels that take only the
// latter (several groups, CUDA); autograd sees the permutes.
Tensor to_channels_first(const Tensor& t) { return contiguous(permute(t, {0, 3, 1, 2})); }
Tensor to_channels_last(const Tensor& t) { return contiguous(permute(t, {0, 2, 3, 1})); }

Tensor conv_op(Kind kind, const Tensor& a, const Tensor& b, const Tensor& bias, const ConvGeom& g);

// A channels-last convolution on a device kernel that takes channels first
// only: the activations are permuted around it.
Tensor conv_op_converted(Kind kind, const Tensor& a, const Tensor& b, const Tensor& bias,
                         const ConvGeom& g) {
  ConvGeom first = g;
  first.channels_last = false;
  const bool b_is_activation = kind == Kind::weight_grad;
  const Tensor out =
      conv_op(kind, to_channels_first(a), b_is_activation ? to_channels_first(b) : b, bias, first);
  return kind == Kind::weight_grad ? out : to_channels_last(out);
}

// One of the three kernels with its backward node; operands already checked.
Tensor conv_op(Kind kind, const Tensor& a, const Tensor& b, const Tensor& bias, const ConvGeom& g) {
  if (g.channels_last && (g.groups != 1 || !device_caps(a.device()).channels_last_conv))
    return conv_op_converted(kind, a, b, bias, g);
  const char* op = kind_name(kind);
  const KernelTable& k = kernels_for(op, {&a, &b, &bias});
  DType dt = promote_types(a.dtype(), b.dtype());
  if (bias.defined()) dt = promote_types(dt, bias.dtype());
  const DType ct = detail::compute_dtype(dt);
  Tensor ap = detail::as_plain(a, ct).contiguous(), bp = detail::as_plain(b, ct).contiguous();
  Tensor biasp = bias.defined() ? detail::as_plain(bias, ct).contiguous() : Tensor();
  Tensor out = detail::make_tensor(out_shape(kind, g), ct, a.device());
  ConvGeom kg = g;
  kg.bf16_products = ct == DType::f32 && mixed_precision_enabled();
  k.conv(kind, ct, kg, ap.raw_data(), bp.raw_data(), biasp.defined() ? biasp.raw_data() : nullptr,
         out.raw_data());
  if (ct != dt) out = detail::as_plain(out, dt);

  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  const bool need_bias = bias.defined() && bias.requires_grad();
  return autograd::record(
      op, out, {a, b, bias},
      [kind, g, a = a.detach(), b = b.detach(), need_a, need_b, need_bias](const Tensor& gout) {
        Tensor ga, gb, gbias;
        switch (kind) {
          case Kind::forward:  // a = x, b = w
            if (need_a) ga = conv_op(Kind::input_grad, gout, b, Tensor(), g);
            if (need_b) gb = conv_op(Kind::weight_grad, a, gout, Tensor(), g);
            break;
          case Kind::input_grad:  // a = g, b = w
            if (need_a) ga = conv_op(Kind::forward, gout, b, Tensor(), g);
            if (need_b) gb = conv_op(Kind::weight_grad, gout, a, Tensor(), g);
            break;
          case Kind::weight_grad:  // a = x, b = g
            if (need_a) ga = conv_op(Kind::input_grad, b, gout, Tensor(), g);
            if (need_b) gb = conv_op(Kind::forward, a, gout, Tensor(), g);
            break;
        }
        // Pixels first (contiguous rows), then images: one
        // pass, where a sum over {0, 2, 3} at once would
        // first copy gout into that order.
        if (need_bias)
          gbias = g.channels_last ? channels_last_bias_grad(gout) : sum(sum(gout, {2, 3}), {0});
        return std::vector<Tensor>{ga, gb, gbias};
      });
}

[[noreturn]] void conv_fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

// Checks shared by both public ops: ranks, dtypes, positive hyper-parameters.
void check_common(const char* op, const Tensor& x, const Tensor& w, const Tensor& b,
                  const Pair& stride, const Pair& padding, const Pair& dilation, int64_t groups,
                  ConvLayout layout) {
  if (!x.defined() || !w.defined()) conv_fail(op, "got an undefined input or weight");
  kernels_for(op, {&x, &w, &b});  // one device for all operands
  if (x.dim() != 4)
    conv_fail(op, std::string("input must be 4-d ") +
                      (layout == ConvLayout::nhwc ? "[N, H, W, C] (layout nhwc)" : "[N, C, H, W]") +
                      ": got shape " + shape_str(x.shape()));
  if (w.dim() != 4) conv_fail(op, "weight must be 4-d: got shape " + shape_str(w.shape()));
  DType dt = promote_types(x.dtype(), w.dtype());
  if (b.defined()) dt = promote_types(dt, b.dtype());
  if (!is_floating(dt))
    conv_fail(op, std::string("needs floating operands: got ") + dtype_name(x.dtype()) +
                      " input and " + dtype_name(w.dtype()) + " weight");
  if (stride[0] < 1 || stride[1] < 1)
    conv_fail(op, "stride must be positive: got " + pair_str(stride));
  if (dilation[0] < 1 || dilation[1] < 1)
    conv_fail(op, "dilation must be positive: got " + pair_str(dilation));
  if (padding[0] < 0 || padding[1] < 0)
    conv_fail(op, "padding must be non-negative: got " + pair_str(padding));
  if (groups < 1) conv_fail(op, "groups must be positive: got " + std::to_string(groups));
}

// An input's sizes, read in its layout.
struct Activation {
  int64_t N, C, H, W;
  Activation(const Tensor& x, ConvLayout layout)
      : N(x.size(0)),
        C(x.size(layout == ConvLayout::nhwc ? 3 : 1)),
        H(x.size(layout == ConvLayout::nhwc ? 1 : 2)),
        W(x.size(layout == ConvLayout::nhwc ? 2 : 3)) {}
};

void check_bias(const char* op, const Tensor& b, int64_t channels) {
  if (b.defined() && (b.dim() != 1 || b.size(0) != channels))
    conv_fail(
        op, "bias must have shape [" + std::to_string(channels) + "]: got " + shape_str(b.shape()));
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, Pair stride, Pair padding,
              Pair dilation, int64_t groups, ConvLayout layout) {
  const char* op = "conv2d";
  check_common(op, x, w, b, stride, padding, dilation, groups, layout);
  const Activation in(x, layout);
  const int64_t C = in.C, O = w.size(0);
  if (C % groups != 0)
    conv_fail(op, "input channels (" + std::to_string(C) + ") are not divisible by groups (" +
                      std::to_string(groups) + ")");
  if (O % groups != 0)
    conv_fail(op, "output channels (" + std::to_string(O) + ") are not divisible by groups (" +
                      std::to_string(groups) + ")");
  if (w.size(1) != C / groups)
    conv_fail(op, "weight " + shape_str(w.shape()) + " expects " +
                      std::to_string(w.size(1) * groups) + " input channels with groups = " +
                      std::to_string(groups) + ": got input " + shape_str(x.shape()));
  check_bias(op, b, O);
  ConvGeom g{in.N, C, in.H,   in.W,    O,        w.size(2), w.size(3),
             0,    0, stride, padding, dilation, groups,    layout == ConvLayout::nhwc};
  const int64_t nh = g.H + 2 * padding[0] - dilation[0] * (g.kh - 1) - 1;
  const int64_t nw = g.W + 2 * padding[1] - dilation[1] * (g.kw - 1) - 1;
  if (nh < 0 || nw < 0)
    conv_fail(op, "output size is not positive: input " + std::to_string(g.H) + "x" +
                      std::to_string(g.W) + " (padded by " + pair_str(padding) +
                      ") is smaller than "
                      "the dilated kernel " +
                      std::to_string(dilation[0] * (g.kh - 1) + 1) + "x" +
                      std::to_string(dilation[1] * (g.kw - 1) + 1));
  g.OH = nh / stride[0] + 1;
  g.OW = nw / stride[1] + 1;
  return conv_op(Kind::forward, x, w, b, g);
}

Tensor conv_transpose2d(const Tensor& x, const Tensor& w, const Tensor& b, Pair stride,
                        Pair padding, Pair output_padding, int64_t groups, Pair dilation,
                        ConvLayout layout) {
  const char* op = "conv_transpose2d";
  check_common(op, x, w, b, stride, padding, dilation, groups, layout);
  const Activation in(x, layout);
  const int64_t Cin = in.C;
  if (w.size(0) != Cin)
    conv_fail(op, "weight " + shape_str(w.shape()) + " expects " + std::to_string(w.size(0)) +
                      " input channels: got input " + shape_str(x.shape()));
  if (Cin % groups != 0)
    conv_fail(op, "input channels (" + std::to_string(Cin) + ") are not divisible by groups (" +
                      std::to_string(groups) + ")");
  for (int d = 0; d < 2; ++d)
    if (output_padding[d] < 0 ||
        (output_padding[d] >= stride[d] && output_padding[d] >= dilation[d]))
      conv_fail(op,
                "output_padding must be non-negative and smaller than stride or dilation: got "
                "output_padding " +
                    pair_str(output_padding) + ", stride " + pair_str(stride) + ", dilation " +
                    pair_str(dilation));
  const int64_t Cout = w.size(1) * groups;
  check_bias(op, b, Cout);
  const int64_t kh = w.size(2), kw = w.size(3);
  const int64_t H =
      (in.H - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + output_padding[0] + 1;
  const int64_t W =
      (in.W - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + output_padding[1] + 1;
  if (H <= 0 || W <= 0)
    conv_fail(op, "output size is not positive: got " + std::to_string(H) + "x" +
                      std::to_string(W) + " from input " + shape_str(x.shape()) + " and weight " +
                      shape_str(w.shape()));
  // The conv2d whose input gradient this is: input [N, Cout, H, W], weight
  // [Cin, Cout / groups, kh, kw], output [N, Cin, x.H, x.W].
  const ConvGeom g{in.N, Cout, H,      W,       Cin,      kh,     kw,
                   in.H, in.W, stride, padding, dilation, groups, layout == ConvLayout::nhwc};
  return conv_op(Kind::input_grad, x, w, b, g);
}

}  // namespace quanta
