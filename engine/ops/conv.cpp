// conv2d and conv_transpose2d. Three kernels share one geometry: the
// convolution y = conv(x, w), its input gradient (the transposed convolution)
// and its weight gradient. All three are the partial derivatives of one
// trilinear form <conv(x, w), g>, so each one's backward is the other two.
#include "engine/ops/conv.h"

#include <algorithm>
#include <memory>
#include <string>

#include "engine/autograd/node.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/ops/elementwise_kernels.h"
#include "engine/ops/reduce.h"

namespace quanta {
namespace {

using Pair = std::array<int64_t, 2>;

// Sizes of one convolution, always seen from the conv2d side:
// input [N, C, H, W], weight [O, C / groups, kh, kw], output [N, O, OH, OW].
struct ConvGeom {
  int64_t N, C, H, W;
  int64_t O, kh, kw;
  int64_t OH, OW;
  Pair stride, padding, dilation;
  int64_t groups;

  int64_t cg() const { return C / groups; }
  int64_t og() const { return O / groups; }
  int64_t ckk() const { return cg() * kh * kw; }  // rows of one group's columns
  int64_t L() const { return OH * OW; }           // output positions per image
  // A 1x1 kernel reading every input pixel once: the input is its own im2col.
  bool pointwise() const {
    return kh == 1 && kw == 1 && stride == Pair{1, 1} && padding == Pair{0, 0} &&
           OH == H && OW == W;
  }
};

enum class Kind {
  forward,      // (x, w) -> y [N, O, OH, OW], bias [O]
  input_grad,   // (g, w) -> [N, C, H, W], bias [C]  (= conv_transpose2d)
  weight_grad,  // (x, g) -> [O, C / groups, kh, kw]
};

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

// Output positions o in [0, n) whose input index o * s + off lies in [0, size).
void valid_range(int64_t off, int64_t s, int64_t size, int64_t n, int64_t& lo,
                 int64_t& hi) {
  lo = off >= 0 ? 0 : (-off + s - 1) / s;
  hi = size - off <= 0 ? 0 : (size - off + s - 1) / s;
  lo = std::min(lo, n);
  hi = std::clamp(hi, lo, n);
}

// cols [Cg kh kw, OH OW] from one group of one image x [Cg, H, W].
template <class T>
void im2col(const T* x, T* cols, const ConvGeom& g) {
  const int64_t L = g.L(), kk = g.kh * g.kw;
  cpu::parallel_for(
      0, g.ckk(), std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(L, 1)),
      [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          const int64_t c = r / kk, i = (r / g.kw) % g.kh, j = r % g.kw;
          const T* plane = x + c * g.H * g.W;
          const int64_t dh = i * g.dilation[0] - g.padding[0],
                        dw = j * g.dilation[1] - g.padding[1];
          int64_t ow_lo, ow_hi;
          valid_range(dw, g.stride[1], g.W, g.OW, ow_lo, ow_hi);
          T* dst = cols + r * L;
          for (int64_t oh = 0; oh < g.OH; ++oh, dst += g.OW) {
            const int64_t ih = oh * g.stride[0] + dh;
            if (ih < 0 || ih >= g.H) {
              std::fill(dst, dst + g.OW, T(0));
              continue;
            }
            const T* row = plane + ih * g.W;  // row[ow * stride + dw] for valid ow
            std::fill(dst, dst + ow_lo, T(0));
            if (g.stride[1] == 1) {
              std::copy(row + ow_lo + dw, row + ow_hi + dw, dst + ow_lo);
            } else {
              for (int64_t ow = ow_lo; ow < ow_hi; ++ow)
                dst[ow] = row[ow * g.stride[1] + dw];
            }
            std::fill(dst + ow_hi, dst + g.OW, T(0));
          }
        }
      });
}

// x [Cg, H, W] += col2im(cols): the adjoint of im2col. Channels are split
// across threads, so no two threads write one pixel.
template <class T>
void col2im(const T* cols, T* x, const ConvGeom& g) {
  const int64_t L = g.L(), kk = g.kh * g.kw;
  cpu::parallel_for(
      0, g.cg(), std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(kk * L, 1)),
      [&](int64_t lo, int64_t hi) {
        for (int64_t c = lo; c < hi; ++c) {
          T* plane = x + c * g.H * g.W;
          for (int64_t i = 0; i < g.kh; ++i)
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t dh = i * g.dilation[0] - g.padding[0];
              const int64_t dw = j * g.dilation[1] - g.padding[1];
              int64_t ow_lo, ow_hi;
              valid_range(dw, g.stride[1], g.W, g.OW, ow_lo, ow_hi);
              const T* src = cols + ((c * g.kh + i) * g.kw + j) * L;
              for (int64_t oh = 0; oh < g.OH; ++oh, src += g.OW) {
                const int64_t ih = oh * g.stride[0] + dh;
                if (ih < 0 || ih >= g.H) continue;
                T* row = plane + ih * g.W;
                for (int64_t ow = ow_lo; ow < ow_hi; ++ow)
                  row[ow * g.stride[1] + dw] += src[ow];
              }
            }
        }
      });
}

// Runs body(n, scratch, worker) for every image n: serially when `workers`
// is 1, else each worker takes a contiguous range of images and its own
// scratch (the GEMMs inside then stay single-threaded).
template <class T, class Body>
void run_images(int64_t N, int64_t workers, int64_t scratch, T* buf, Body body) {
  if (workers == 1) {
    for (int64_t n = 0; n < N; ++n) body(n, buf, 0);
    return;
  }
  const int64_t step = (N + workers - 1) / workers;
  cpu::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      for (int64_t n = w * step; n < std::min(N, (w + 1) * step); ++n)
        body(n, buf ? buf + w * scratch : nullptr, w);
  });
}

// One kernel of `kind` on contiguous plain operands; `out` is uninitialised.
template <class T>
void conv_kernel(Kind kind, const T* a, const T* b, const T* bias, T* out,
                 const ConvGeom& g) {
  const int64_t cg = g.cg(), og = g.og(), ckk = g.ckk(), L = g.L(), HW = g.H * g.W;
  const bool pw = g.pointwise();
  const int64_t scratch = pw ? 0 : ckk * L;
  // Whole images per thread when there are enough of them or they are small;
  // otherwise one image after another with Eigen threading each GEMM.
  const double work = static_cast<double>(g.O) * ckk * L;
  const int threads = num_threads();
  int64_t workers = 1;
  if (g.N > 1 && threads > 1 && (g.N >= threads || work < 128.0 * 128 * 128))
    workers = std::min<int64_t>(threads, g.N);
  std::unique_ptr<T[]> buf(scratch > 0 ? new T[workers * scratch] : nullptr);

  if (kind == Kind::forward) {
    // y[n, group] [og, L] = w[group] [og, ckk] . cols [ckk, L]
    run_images<T>(g.N, workers, scratch, buf.get(), [&](int64_t n, T* cols, int64_t) {
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const T* x = a + (n * g.C + gi * cg) * HW;
        const T* w = b + gi * og * ckk;
        T* y = out + (n * g.O + gi * og) * L;
        if (pw)
          cols = const_cast<T*>(x);
        else
          im2col(x, cols, g);
        if (bias)
          for (int64_t o = 0; o < og; ++o)
            std::fill(y + o * L, y + (o + 1) * L, bias[gi * og + o]);
        cpu::gemm<T>(og, L, ckk, {w, ckk, 1}, {cols, L, 1}, y, L, bias != nullptr);
      }
    });
  } else if (kind == Kind::input_grad) {
    // cols [ckk, L] = w[group]^T [ckk, og] . g[n, group] [og, L], then col2im.
    run_images<T>(g.N, workers, scratch, buf.get(), [&](int64_t n, T* cols, int64_t) {
      T* xn = out + n * g.C * HW;
      if (bias) {
        for (int64_t c = 0; c < g.C; ++c)
          std::fill(xn + c * HW, xn + (c + 1) * HW, bias[c]);
      } else if (!pw) {
        std::fill(xn, xn + g.C * HW, T(0));
      }
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const T* gy = a + (n * g.O + gi * og) * L;
        const T* w = b + gi * og * ckk;
        T* x = xn + gi * cg * HW;
        if (pw) {
          cpu::gemm<T>(cg, L, og, {w, 1, ckk}, {gy, L, 1}, x, L, bias != nullptr);
        } else {
          cpu::gemm<T>(ckk, L, og, {w, 1, ckk}, {gy, L, 1}, cols, L);
          col2im(cols, x, g);
        }
      }
    });
  } else {
    // gw[group] [og, ckk] += g[n, group] [og, L] . cols^T [L, ckk], one
    // partial sum per worker.
    const int64_t wsize = g.O * ckk;
    std::unique_ptr<T[]> partial(workers > 1 ? new T[workers * wsize] : nullptr);
    T* acc0 = workers > 1 ? partial.get() : out;
    std::fill(acc0, acc0 + workers * wsize, T(0));
    run_images<T>(g.N, workers, scratch, buf.get(),
                  [&](int64_t n, T* cols, int64_t worker) {
                    T* acc = acc0 + worker * wsize;
                    for (int64_t gi = 0; gi < g.groups; ++gi) {
                      const T* x = a + (n * g.C + gi * cg) * HW;
                      const T* gy = b + (n * g.O + gi * og) * L;
                      if (pw)
                        cols = const_cast<T*>(x);
                      else
                        im2col(x, cols, g);
                      cpu::gemm<T>(og, ckk, L, {gy, L, 1}, {cols, 1, L},
                                   acc + gi * og * ckk, ckk, true);
                    }
                  });
    if (workers > 1) {
      std::copy(acc0, acc0 + wsize, out);
      for (int64_t w = 1; w < workers; ++w)
        for (int64_t i = 0; i < wsize; ++i) out[i] += acc0[w * wsize + i];
    }
  }
}

Shape out_shape(Kind kind, const ConvGeom& g) {
  switch (kind) {
    case Kind::forward:
      return {g.N, g.O, g.OH, g.OW};
    case Kind::input_grad:
      return {g.N, g.C, g.H, g.W};
    default:
      return {g.O, g.cg(), g.kh, g.kw};
  }
}

// One of the three kernels with its backward node; operands already checked.
Tensor conv_op(Kind kind, const Tensor& a, const Tensor& b, const Tensor& bias,
               const ConvGeom& g) {
  const char* op = kind_name(kind);
  detail::check_cpu(op, {&a, &b, &bias});
  DType dt = promote_types(a.dtype(), b.dtype());
  if (bias.defined()) dt = promote_types(dt, bias.dtype());
  const DType ct = detail::cpu_compute_dtype(dt);
  Tensor ap = detail::as_plain(a, ct).contiguous(),
         bp = detail::as_plain(b, ct).contiguous();
  Tensor biasp = bias.defined() ? detail::as_plain(bias, ct).contiguous() : Tensor();
  Tensor out = detail::make_tensor(out_shape(kind, g), ct, Device::cpu());
  dispatch_float(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    conv_kernel<T>(kind, ap.data<T>(), bp.data<T>(),
                   biasp.defined() ? biasp.data<T>() : nullptr, out.data<T>(), g);
  });
  if (ct != dt) out = detail::as_plain(out, dt);

  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  const bool need_bias = bias.defined() && bias.requires_grad();
  return autograd::record(op, out, {a, b, bias},
                          [kind, g, a = a.detach(), b = b.detach(), need_a, need_b,
                           need_bias](const Tensor& gout) {
                            Tensor ga, gb, gbias;
                            switch (kind) {
                              case Kind::forward:  // a = x, b = w
                                if (need_a)
                                  ga = conv_op(Kind::input_grad, gout, b, Tensor(), g);
                                if (need_b)
                                  gb = conv_op(Kind::weight_grad, a, gout, Tensor(), g);
                                break;
                              case Kind::input_grad:  // a = g, b = w
                                if (need_a)
                                  ga = conv_op(Kind::forward, gout, b, Tensor(), g);
                                if (need_b)
                                  gb = conv_op(Kind::weight_grad, gout, a, Tensor(), g);
                                break;
                              case Kind::weight_grad:  // a = x, b = g
                                if (need_a)
                                  ga = conv_op(Kind::input_grad, b, gout, Tensor(), g);
                                if (need_b)
                                  gb = conv_op(Kind::forward, a, gout, Tensor(), g);
                                break;
                            }
                            if (need_bias) gbias = sum(gout, {0, 2, 3});
                            return std::vector<Tensor>{ga, gb, gbias};
                          });
}

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

std::string pair_str(const Pair& p) {
  return "(" + std::to_string(p[0]) + ", " + std::to_string(p[1]) + ")";
}

// Checks shared by both public ops: ranks, dtypes, positive hyper-parameters.
void check_common(const char* op, const Tensor& x, const Tensor& w, const Tensor& b,
                  const Pair& stride, const Pair& padding, const Pair& dilation,
                  int64_t groups) {
  if (!x.defined() || !w.defined()) fail(op, "got an undefined input or weight");
  detail::check_cpu(op, {&x, &w, &b});
  if (x.dim() != 4)
    fail(op, "input must be 4-d [N, C, H, W]: got shape " + shape_str(x.shape()));
  if (w.dim() != 4) fail(op, "weight must be 4-d: got shape " + shape_str(w.shape()));
  DType dt = promote_types(x.dtype(), w.dtype());
  if (b.defined()) dt = promote_types(dt, b.dtype());
  if (!is_floating(dt))
    fail(op, std::string("needs floating operands: got ") + dtype_name(x.dtype()) +
                 " input and " + dtype_name(w.dtype()) + " weight");
  if (stride[0] < 1 || stride[1] < 1)
    fail(op, "stride must be positive: got " + pair_str(stride));
  if (dilation[0] < 1 || dilation[1] < 1)
    fail(op, "dilation must be positive: got " + pair_str(dilation));
  if (padding[0] < 0 || padding[1] < 0)
    fail(op, "padding must be non-negative: got " + pair_str(padding));
  if (groups < 1) fail(op, "groups must be positive: got " + std::to_string(groups));
}

void check_bias(const char* op, const Tensor& b, int64_t channels) {
  if (b.defined() && (b.dim() != 1 || b.size(0) != channels))
    fail(op, "bias must have shape [" + std::to_string(channels) + "]: got " +
                 shape_str(b.shape()));
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, Pair stride,
              Pair padding, Pair dilation, int64_t groups) {
  const char* op = "conv2d";
  check_common(op, x, w, b, stride, padding, dilation, groups);
  const int64_t C = x.size(1), O = w.size(0);
  if (C % groups != 0)
    fail(op, "input channels (" + std::to_string(C) + ") are not divisible by groups (" +
                 std::to_string(groups) + ")");
  if (O % groups != 0)
    fail(op, "output channels (" + std::to_string(O) + ") are not divisible by groups (" +
                 std::to_string(groups) + ")");
  if (w.size(1) != C / groups)
    fail(op, "weight " + shape_str(w.shape()) + " expects " +
                 std::to_string(w.size(1) * groups) + " input channels with groups = " +
                 std::to_string(groups) + ": got input " + shape_str(x.shape()));
  check_bias(op, b, O);
  ConvGeom g{x.size(0), C, x.size(2), x.size(3), O,        w.size(2), w.size(3),
             0,         0, stride,    padding,   dilation, groups};
  const int64_t nh = g.H + 2 * padding[0] - dilation[0] * (g.kh - 1) - 1;
  const int64_t nw = g.W + 2 * padding[1] - dilation[1] * (g.kw - 1) - 1;
  if (nh < 0 || nw < 0)
    fail(op, "output size is not positive: input " + std::to_string(g.H) + "x" +
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
                        Pair padding, Pair output_padding, int64_t groups,
                        Pair dilation) {
  const char* op = "conv_transpose2d";
  check_common(op, x, w, b, stride, padding, dilation, groups);
  const int64_t Cin = x.size(1);
  if (w.size(0) != Cin)
    fail(op, "weight " + shape_str(w.shape()) + " expects " + std::to_string(w.size(0)) +
                 " input channels: got input " + shape_str(x.shape()));
  if (Cin % groups != 0)
    fail(op, "input channels (" + std::to_string(Cin) +
                 ") are not divisible by groups (" + std::to_string(groups) + ")");
  for (int d = 0; d < 2; ++d)
    if (output_padding[d] < 0 ||
        (output_padding[d] >= stride[d] && output_padding[d] >= dilation[d]))
      fail(op,
           "output_padding must be non-negative and smaller than stride or dilation: got "
           "output_padding " +
               pair_str(output_padding) + ", stride " + pair_str(stride) + ", dilation " +
               pair_str(dilation));
  const int64_t Cout = w.size(1) * groups;
  check_bias(op, b, Cout);
  const int64_t kh = w.size(2), kw = w.size(3);
  const int64_t H = (x.size(2) - 1) * stride[0] - 2 * padding[0] +
                    dilation[0] * (kh - 1) + output_padding[0] + 1;
  const int64_t W = (x.size(3) - 1) * stride[1] - 2 * padding[1] +
                    dilation[1] * (kw - 1) + output_padding[1] + 1;
  if (H <= 0 || W <= 0)
    fail(op, "output size is not positive: got " + std::to_string(H) + "x" +
                 std::to_string(W) + " from input " + shape_str(x.shape()) +
                 " and weight " + shape_str(w.shape()));
  // The conv2d whose input gradient this is: input [N, Cout, H, W], weight
  // [Cin, Cout / groups, kh, kw], output [N, Cin, x.H, x.W].
  const ConvGeom g{x.size(0), Cout,      H,      W,       Cin,      kh,    kw,
                   x.size(2), x.size(3), stride, padding, dilation, groups};
  return conv_op(Kind::input_grad, x, w, b, g);
}

}  // namespace quanta
