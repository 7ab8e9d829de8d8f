// Pooling and nearest upsampling. Every kernel here is linear in its input
// (max pooling once its argmax is fixed), so each backward is the adjoint
// kernel, recorded as an op whose own backward is the forward again.
#include "engine/ops/pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/ops/elementwise_kernels.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

using Pair = std::array<int64_t, 2>;

// P planes of H x W pooled to OH x OW.
struct PoolGeom {
  int64_t P, H, W, OH, OW;
  Pair kernel, stride, padding, dilation;
  Shape in_shape, out_shape;
};

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

std::string pair_str(const Pair& p) {
  return "(" + std::to_string(p[0]) + ", " + std::to_string(p[1]) + ")";
}

// Validates x and the window parameters; fills in a stride of 0 as kernel.
PoolGeom pool_geom(const char* op, const Tensor& x, Pair kernel, Pair stride,
                   Pair padding, Pair dilation) {
  detail::check_cpu(op, {&x});
  if (x.dim() != 3 && x.dim() != 4)
    fail(op,
         "input must be [N, C, H, W] or [C, H, W]: got shape " + shape_str(x.shape()));
  if (!is_floating(x.dtype()))
    fail(op, std::string("needs a floating input: got ") + dtype_name(x.dtype()));
  if (kernel[0] < 1 || kernel[1] < 1)
    fail(op, "kernel must be positive: got " + pair_str(kernel));
  if (stride[0] < 0 || stride[1] < 0)
    fail(op,
         "stride must be positive (0 means the kernel size): got " + pair_str(stride));
  if (dilation[0] < 1 || dilation[1] < 1)
    fail(op, "dilation must be positive: got " + pair_str(dilation));
  for (int d = 0; d < 2; ++d) {
    if (stride[d] == 0) stride[d] = kernel[d];
    const int64_t extent = dilation[d] * (kernel[d] - 1) + 1;
    if (padding[d] < 0 || padding[d] > extent / 2)
      fail(op, "padding must be between 0 and half the kernel: got padding " +
                   pair_str(padding) + " for kernel " + pair_str(kernel) +
                   (dilation == Pair{1, 1} ? std::string()
                                           : " dilated by " + pair_str(dilation)));
  }
  PoolGeom g;
  g.H = x.size(-2);
  g.W = x.size(-1);
  g.P = g.H * g.W == 0 ? 0 : x.numel() / (g.H * g.W);
  const int64_t nh = g.H + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1;
  const int64_t nw = g.W + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1;
  if (nh < 0 || nw < 0)
    fail(op, "output size is not positive: input " + std::to_string(g.H) + "x" +
                 std::to_string(g.W) + " is smaller than the kernel " + pair_str(kernel));
  g.OH = nh / stride[0] + 1;
  g.OW = nw / stride[1] + 1;
  g.kernel = kernel;
  g.stride = stride;
  g.padding = padding;
  g.dilation = dilation;
  g.in_shape = x.shape();
  g.out_shape = x.shape();
  g.out_shape[x.dim() - 2] = g.OH;
  g.out_shape[x.dim() - 1] = g.OW;
  return g;
}

int64_t plane_grain(int64_t plane_work) {
  return std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(plane_work, 1));
}

// Runs `kernel<T>(in, out)` on `t` as a contiguous plain tensor of the compute
// dtype, giving an (uninitialised) output of `shape` in t's dtype.
template <class F>
Tensor run_float(const char* op, const Tensor& t, const Shape& shape, F kernel) {
  const DType ct = detail::cpu_compute_dtype(t.dtype());
  Tensor in = detail::as_plain(t, ct).contiguous();
  Tensor out = detail::make_tensor(shape, ct, Device::cpu());
  dispatch_float(ct, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    kernel(in.data<T>(), out.data<T>(), T{});
  });
  return ct == t.dtype() ? out : detail::as_plain(out, t.dtype());
}

// ---- average pooling: forward and its adjoint ----

Tensor avg_op(bool adjoint, const Tensor& t, const PoolGeom& g) {
  const char* op = adjoint ? "avg_pool2d_backward" : "avg_pool2d";
  Tensor out = run_float(
      op, t, adjoint ? g.in_shape : g.out_shape, [&](const auto* in, auto* o, auto zero) {
        using T = decltype(zero);
        const T inv = T(1) / static_cast<T>(g.kernel[0] * g.kernel[1]);
        const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
        cpu::parallel_for(0, g.P, plane_grain(ohw * g.kernel[0] * g.kernel[1]),
                          [&](int64_t lo, int64_t hi) {
                            for (int64_t p = lo; p < hi; ++p) {
                              const T* src = in + p * (adjoint ? ohw : hw);
                              T* dst = o + p * (adjoint ? hw : ohw);
                              if (adjoint) std::fill(dst, dst + hw, T(0));
                              for (int64_t oh = 0; oh < g.OH; ++oh) {
                                const int64_t h0 = oh * g.stride[0] - g.padding[0];
                                const int64_t hlo = std::max<int64_t>(h0, 0),
                                              hhi = std::min(h0 + g.kernel[0], g.H);
                                for (int64_t ow = 0; ow < g.OW; ++ow) {
                                  const int64_t w0 = ow * g.stride[1] - g.padding[1];
                                  const int64_t wlo = std::max<int64_t>(w0, 0),
                                                whi = std::min(w0 + g.kernel[1], g.W);
                                  if (adjoint) {
                                    const T v = src[oh * g.OW + ow] * inv;
                                    for (int64_t ih = hlo; ih < hhi; ++ih)
                                      for (int64_t iw = wlo; iw < whi; ++iw)
                                        dst[ih * g.W + iw] += v;
                                  } else {
                                    T s = 0;
                                    for (int64_t ih = hlo; ih < hhi; ++ih)
                                      for (int64_t iw = wlo; iw < whi; ++iw)
                                        s += src[ih * g.W + iw];
                                    dst[oh * g.OW + ow] = s * inv;
                                  }
                                }
                              }
                            }
                          });
      });
  return autograd::record(op, out, {t}, [adjoint, g](const Tensor& gout) {
    return std::vector<Tensor>{avg_op(!adjoint, gout, g)};
  });
}

// ---- max pooling: argmax positions, scatter to them and gather from them ----

// idx [P, OH, OW] (i64): flat position in the H x W plane of each window's
// maximum, -1 for a window that lies entirely in the padding.
Tensor pool_scatter(const Tensor& gy, const Tensor& idx, const PoolGeom& g);

Tensor pool_gather(const Tensor& gx, const Tensor& idx, const PoolGeom& g) {
  const int64_t* ix = idx.data<int64_t>();
  Tensor out = run_float(
      "max_pool2d_gather", gx, g.out_shape, [&](const auto* in, auto* o, auto zero) {
        using T = decltype(zero);
        const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
        cpu::parallel_for(0, g.P, plane_grain(ohw), [&](int64_t lo, int64_t hi) {
          for (int64_t p = lo; p < hi; ++p)
            for (int64_t i = p * ohw; i < (p + 1) * ohw; ++i)
              o[i] = ix[i] >= 0 ? in[p * hw + ix[i]] : T(0);
        });
      });
  return autograd::record("max_pool2d_gather", out, {gx}, [idx, g](const Tensor& gout) {
    return std::vector<Tensor>{pool_scatter(gout, idx, g)};
  });
}

Tensor pool_scatter(const Tensor& gy, const Tensor& idx, const PoolGeom& g) {
  const int64_t* ix = idx.data<int64_t>();
  Tensor out = run_float(
      "max_pool2d_backward", gy, g.in_shape, [&](const auto* in, auto* o, auto zero) {
        using T = decltype(zero);
        const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
        cpu::parallel_for(0, g.P, plane_grain(ohw + hw), [&](int64_t lo, int64_t hi) {
          for (int64_t p = lo; p < hi; ++p) {
            T* dst = o + p * hw;
            std::fill(dst, dst + hw, T(0));
            for (int64_t i = p * ohw; i < (p + 1) * ohw; ++i)
              if (ix[i] >= 0) dst[ix[i]] += in[i];
          }
        });
      });
  return autograd::record("max_pool2d_backward", out, {gy}, [idx, g](const Tensor& gout) {
    return std::vector<Tensor>{pool_gather(gout, idx, g)};
  });
}

}  // namespace

Tensor avg_pool2d(const Tensor& x, Pair kernel, Pair stride, Pair padding) {
  const PoolGeom g = pool_geom("avg_pool2d", x, kernel, stride, padding, {1, 1});
  return avg_op(false, x, g);
}

Tensor max_pool2d(const Tensor& x, Pair kernel, Pair stride, Pair padding,
                  Pair dilation) {
  const PoolGeom g = pool_geom("max_pool2d", x, kernel, stride, padding, dilation);
  Tensor idx = detail::make_tensor(g.out_shape, DType::i64, Device::cpu());
  int64_t* ix = idx.data<int64_t>();
  Tensor out =
      run_float("max_pool2d", x, g.out_shape, [&](const auto* in, auto* o, auto zero) {
        using T = decltype(zero);
        const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
        cpu::parallel_for(0, g.P, plane_grain(ohw * g.kernel[0] * g.kernel[1]),
                          [&](int64_t lo, int64_t hi) {
                            for (int64_t p = lo; p < hi; ++p) {
                              const T* src = in + p * hw;
                              for (int64_t oh = 0; oh < g.OH; ++oh)
                                for (int64_t ow = 0; ow < g.OW; ++ow) {
                                  T best = -std::numeric_limits<T>::infinity();
                                  int64_t arg = -1;
                                  for (int64_t i = 0; i < g.kernel[0]; ++i) {
                                    const int64_t ih = oh * g.stride[0] - g.padding[0] +
                                                       i * g.dilation[0];
                                    if (ih < 0 || ih >= g.H) continue;
                                    for (int64_t j = 0; j < g.kernel[1]; ++j) {
                                      const int64_t iw = ow * g.stride[1] - g.padding[1] +
                                                         j * g.dilation[1];
                                      if (iw < 0 || iw >= g.W) continue;
                                      const T v = src[ih * g.W + iw];
                                      // Like PyTorch: the first maximum wins; NaN
                                      // propagates.
                                      if (arg < 0 || v > best || std::isnan(v)) {
                                        best = v;
                                        arg = ih * g.W + iw;
                                      }
                                    }
                                  }
                                  o[p * ohw + oh * g.OW + ow] = best;
                                  ix[p * ohw + oh * g.OW + ow] = arg;
                                }
                            }
                          });
      });
  return autograd::record("max_pool2d", out, {x}, [idx, g](const Tensor& gout) {
    return std::vector<Tensor>{pool_scatter(gout, idx, g)};
  });
}

Tensor interpolate_nearest2x(const Tensor& x) {
  const char* op = "interpolate_nearest2x";
  detail::check_cpu(op, {&x});
  if (x.dim() != 3 && x.dim() != 4)
    fail(op,
         "input must be [N, C, H, W] or [C, H, W]: got shape " + shape_str(x.shape()));
  const int64_t nd = x.dim(), H = x.size(-2), W = x.size(-1);
  Shape out_shape = x.shape();
  out_shape[nd - 2] = 2 * H;
  out_shape[nd - 1] = 2 * W;
  Tensor in = x.detach().contiguous();
  Tensor out = detail::make_tensor(out_shape, x.dtype(), Device::cpu());
  const int64_t rows = H * W == 0 ? 0 : x.numel() / W;  // input rows over all planes
  dispatch_all(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* src = in.data<T>();
    T* dst = out.data<T>();
    cpu::parallel_for(0, rows, plane_grain(4 * W), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        // Input row r becomes output rows 2r and 2r + 1 (planes stack rows).
        const T* s = src + r * W;
        T* d = dst + 2 * r * 2 * W;
        for (int64_t j = 0; j < W; ++j) d[2 * j] = d[2 * j + 1] = s[j];
        std::copy(d, d + 2 * W, d + 2 * W);
      }
    });
  });
  return autograd::record(op, out, {x}, [shape = x.shape()](const Tensor& g) {
    const int64_t nd = static_cast<int64_t>(shape.size());
    Shape blocks(shape.begin(), shape.end() - 2);
    blocks.insert(blocks.end(), {shape[nd - 2], 2, shape[nd - 1], 2});
    return std::vector<Tensor>{sum(reshape(g, blocks), {nd - 1, nd + 1})};
  });
}

}  // namespace quanta
