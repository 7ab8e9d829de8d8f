// The CUDA pooling kernels, one thread per output element (or per input
// element for the adjoints), with the CPU's index math (engine/cpu/
// pool_kernels.cpp). The adjoints gather: each input element sums the windows
// (or max-pool outputs) that reach it, in the order the CPU's scatter adds
// them, so they need no atomics, are deterministic and match the CPU bit for
// bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"

namespace quanta::cuda {
namespace {

// PoolWindow as plain scalars for device code.
struct Win {
  int64_t H, W, OH, OW;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
};

Win flat(const PoolWindow& g) {
  return {g.H,         g.W,         g.OH,         g.OW,         g.kernel[0],   g.kernel[1],
          g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1]};
}

// a * b rounded on its own: never fused into a following add (the CPU's
// adjoint multiplies first, then adds).
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }

__device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

#define QUANTA_GRID_LOOP(e, total)                                                         \
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; \
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)

// out [P, OH, OW]: the sum of each window's in-plane part, times inv.
template <class T>
__global__ void avg_forward_kernel(int64_t total, Win g, T inv, const T* in, T* out) {
  QUANTA_GRID_LOOP(e, total) {
    const int64_t ow = e % g.OW, oh = (e / g.OW) % g.OH, p = e / (g.OW * g.OH);
    const T* src = in + p * g.H * g.W;
    const int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
    const int64_t hlo = h0 > 0 ? h0 : 0, hhi = h0 + g.kh < g.H ? h0 + g.kh : g.H;
    const int64_t wlo = w0 > 0 ? w0 : 0, whi = w0 + g.kw < g.W ? w0 + g.kw : g.W;
    T s = 0;
    for (int64_t ih = hlo; ih < hhi; ++ih)
      for (int64_t iw = wlo; iw < whi; ++iw) s += src[ih * g.W + iw];
    out[e] = s * inv;
  }
}

// out [P, H, W]: the sum of in [P, OH, OW] * inv over the windows (rows
// oh sh - ph .. + kh, columns likewise) that cover each element, in (oh, ow)
// order.
template <class T>
__global__ void avg_adjoint_kernel(int64_t total, Win g, T inv, const T* in, T* out) {
  QUANTA_GRID_LOOP(e, total) {
    const int64_t iw = e % g.W, ih = (e / g.W) % g.H, p = e / (g.W * g.H);
    const T* src = in + p * g.OH * g.OW;
    // Window oh covers ih when oh sh - ph <= ih < oh sh - ph + kh.
    const int64_t qh = ih + g.ph - g.kh + 1, qw = iw + g.pw - g.kw + 1;
    const int64_t oh_lo = qh <= 0 ? 0 : (qh + g.sh - 1) / g.sh;
    const int64_t ow_lo = qw <= 0 ? 0 : (qw + g.sw - 1) / g.sw;
    const int64_t oh_hi = imin((ih + g.ph) / g.sh + 1, g.OH);  // exclusive
    const int64_t ow_hi = imin((iw + g.pw) / g.sw + 1, g.OW);
    T s = 0;
    for (int64_t oh = oh_lo; oh < oh_hi; ++oh)
      for (int64_t ow = ow_lo; ow < ow_hi; ++ow) s += mul_rn(src[oh * g.OW + ow], inv);
    out[e] = s;
  }
}

// out, idx [P, OH, OW]: each (dilated) window's first maximum and its flat
// position in the plane; the CPU's rule, NaN beating everything.
template <class T>
__global__ void max_forward_kernel(int64_t total, Win g, const T* in, T* out, int64_t* idx) {
  QUANTA_GRID_LOOP(e, total) {
    const int64_t ow = e % g.OW, oh = (e / g.OW) % g.OH, p = e / (g.OW * g.OH);
    const T* src = in + p * g.H * g.W;
    T best = -std::numeric_limits<T>::infinity();
    int64_t arg = -1;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t ih = oh * g.sh - g.ph + i * g.dh;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t iw = ow * g.sw - g.pw + j * g.dw;
        if (iw < 0 || iw >= g.W) continue;
        const T v = src[ih * g.W + iw];
        if (arg < 0 || v > best || v != v) {
          best = v;
          arg = ih * g.W + iw;
        }
      }
    }
    out[e] = best;
    idx[e] = arg;
  }
}

// out [P, OH, OW] = in [P, H, W] at idx (0 for -1).
template <class T>
__global__ void max_gather_kernel(int64_t total, Win g, const int64_t* idx, const T* in, T* out) {
  QUANTA_GRID_LOOP(e, total) {
    const int64_t p = e / (g.OH * g.OW);
    const int64_t i = idx[e];
    out[e] = i >= 0 ? in[p * g.H * g.W + i] : T(0);
  }
}

// out [P, H, W]: the sum of in [P, OH, OW] over the outputs whose index is
// this element, in output order. Only windows that can reach the element are
// visited: oh sh - ph + i dh = ih for some i < kh.
template <class T>
__global__ void max_scatter_kernel(int64_t total, Win g, const int64_t* idx, const T* in, T* out) {
  QUANTA_GRID_LOOP(e, total) {
    const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
    const int64_t q = e % hw, p = e / hw;
    const int64_t ih = q / g.W, iw = q % g.W;
    const int64_t qh = ih + g.ph - (g.kh - 1) * g.dh, qw = iw + g.pw - (g.kw - 1) * g.dw;
    const int64_t oh_lo = qh <= 0 ? 0 : (qh + g.sh - 1) / g.sh;
    const int64_t ow_lo = qw <= 0 ? 0 : (qw + g.sw - 1) / g.sw;
    const int64_t oh_hi = imin((ih + g.ph) / g.sh + 1, g.OH);  // exclusive
    const int64_t ow_hi = imin((iw + g.pw) / g.sw + 1, g.OW);
    const int64_t* ix = idx + p * ohw;
    const T* src = in + p * ohw;
    T s = 0;
    for (int64_t oh = oh_lo; oh < oh_hi; ++oh)
      for (int64_t ow = ow_lo; ow < ow_hi; ++ow) {
        const int64_t o = oh * g.OW + ow;
        if (ix[o] == q) s += src[o];
      }
    out[e] = s;
  }
}

// out [2 rows, 2 W] from in [rows, W]: out[R, c] = in[R / 2, c / 2].
template <class T>
__global__ void upsample2x_kernel(int64_t total, int64_t W, const T* in, T* out) {
  QUANTA_GRID_LOOP(e, total) {
    const int64_t c = e % (2 * W), r = e / (2 * W) / 2;
    out[e] = in[r * W + c / 2];
  }
}

#undef QUANTA_GRID_LOOP

}  // namespace

void avg_pool(bool adjoint, DType dtype, const PoolWindow& g, const void* in, void* out) {
  dispatch_float(dtype, adjoint ? "avg_pool2d_backward" : "avg_pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // The CPU's divisor, computed on the host the same way.
    const T inv = T(1) / static_cast<T>(g.kernel[0] * g.kernel[1]);
    if (adjoint)
      launch_elements(g.P * g.H * g.W, avg_adjoint_kernel<T>, flat(g), inv,
                      static_cast<const T*>(in), static_cast<T*>(out));
    else
      launch_elements(g.P * g.OH * g.OW, avg_forward_kernel<T>, flat(g), inv,
                      static_cast<const T*>(in), static_cast<T*>(out));
  });
}

void max_pool(DType dtype, const PoolWindow& g, const void* in, void* out, int64_t* indices) {
  dispatch_float(dtype, "max_pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_elements(g.P * g.OH * g.OW, max_forward_kernel<T>, flat(g), static_cast<const T*>(in),
                    static_cast<T*>(out), indices);
  });
}

void max_pool_route(bool scatter, DType dtype, const PoolWindow& g, const int64_t* indices,
                    const void* in, void* out) {
  dispatch_float(dtype, scatter ? "max_pool2d_backward" : "max_pool2d_gather", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (scatter)
      launch_elements(g.P * g.H * g.W, max_scatter_kernel<T>, flat(g), indices,
                      static_cast<const T*>(in), static_cast<T*>(out));
    else
      launch_elements(g.P * g.OH * g.OW, max_gather_kernel<T>, flat(g), indices,
                      static_cast<const T*>(in), static_cast<T*>(out));
  });
}

void upsample_nearest2x(DType dtype, int64_t rows, int64_t W, const void* in, void* out) {
  dispatch_all(dtype, "interpolate_nearest2x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_elements(4 * rows * W, upsample2x_kernel<T>, W, static_cast<const T*>(in),
                    static_cast<T*>(out));
  });
}

}  // namespace quanta::cuda
