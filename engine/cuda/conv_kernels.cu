// The CUDA convolution kernels: cuDNN's (engine/cuda/cudnn_conv.cpp) where it
// takes the convolution, else the CPU's im2col + GEMM scheme (engine/cpu/
// conv_kernels.cpp) with the columns of a chunk of images built by one
// grid-stride kernel and the products run by the table's cuBLAS GEMM,
// batched over groups (over images too when groups is 1). col2im is a gather:
// one thread per input pixel sums the kernel taps that read it, in the CPU's
// tap order, so the adjoint needs no atomics and is deterministic; the weight
// gradient accumulates one image after another. Channels-last activations
// are transposed around that path where cuDNN does not take them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/cuda/check.cuh"
#include "engine/cuda/cudnn_conv.h"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/cuda/scratch.h"
#include "engine/kernels/copy_transposed.h"

namespace quanta::cuda {
namespace {

// Bytes of im2col columns one chunk of images may take.
constexpr int64_t kColsBudget = int64_t(256) << 20;

// ConvGeom as plain scalars for device code.
struct Geom {
  int64_t C, H, W, kh, kw, OH, OW;
  int64_t sh, sw, ph, pw, dh, dw;
};

Geom flat(const ConvGeom& g) {
  return {g.C,         g.H,         g.W,          g.kh,         g.kw,          g.OH,         g.OW,
          g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1]};
}

// cols [S, C kh kw, OH OW] of images x [S, C, H, W]: row (c, i, j), column
// (oh, ow) holds x[c, oh sh - ph + i dh, ow sw - pw + j dw], 0 in the padding
// (the CPU's im2col for every group of every image at once).
template <class T>
__global__ void im2col_kernel(int64_t total, Geom g, const T* x, T* cols) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    int64_t t = e;
    const int64_t ow = t % g.OW;
    t /= g.OW;
    const int64_t oh = t % g.OH;
    t /= g.OH;
    const int64_t j = t % g.kw;
    t /= g.kw;
    const int64_t i = t % g.kh;
    t /= g.kh;  // t = s C + c: the input plane
    const int64_t ih = oh * g.sh - g.ph + i * g.dh;
    const int64_t iw = ow * g.sw - g.pw + j * g.dw;
    cols[e] = ih >= 0 && ih < g.H && iw >= 0 && iw < g.W ? x[(t * g.H + ih) * g.W + iw] : T(0);
  }
}

// x [S, C, H, W] = (bias[c] or 0) + the sum, over the kernel taps (i, j) that
// read pixel (ih, iw), of cols [S, C kh kw, OH OW] at row (c, i, j) and the
// output position of that read; taps in the CPU col2im's order.
template <class T>
__global__ void col2im_kernel(int64_t total, Geom g, const T* cols, const T* bias, T* x) {
  const int64_t L = g.OH * g.OW;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    int64_t t = e;
    const int64_t iw = t % g.W;
    t /= g.W;
    const int64_t ih = t % g.H;
    t /= g.H;  // t = s C + c
    T s = bias ? bias[t % g.C] : T(0);
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t hh = ih + g.ph - i * g.dh;  // = oh sh
      if (hh < 0 || hh % g.sh != 0 || hh / g.sh >= g.OH) continue;
      const int64_t oh = hh / g.sh;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t ww = iw + g.pw - j * g.dw;  // = ow sw
        if (ww < 0 || ww % g.sw != 0 || ww / g.sw >= g.OW) continue;
        s += cols[((t * g.kh + i) * g.kw + j) * L + oh * g.OW + ww / g.sw];
      }
    }
    x[e] = s;
  }
}

// out [total / (channels plane)] blocks of [channels, plane]: out = bias[c].
template <class T>
__global__ void fill_channels_kernel(int64_t total, int64_t channels, int64_t plane, const T* bias,
                                     T* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step)
    out[e] = bias[(e / plane) % channels];
}

// C_i = A_i B_i (+= when accumulate) for i < batch through the table's GEMM:
// A_i [m, k] at a + i sa with strides (ars, acs), B_i [k, n] at b + i sb with
// strides (brs, bcs), C_i row-major [m, n] at c + i m n. Offsets in arithmetic
// progression become one strided-batched cuBLAS call.
template <class T>
void gemm_batch(int64_t batch, int64_t m, int64_t n, int64_t k, const T* a, int64_t ars,
                int64_t acs, int64_t sa, const T* b, int64_t brs, int64_t bcs, int64_t sb, T* c,
                bool accumulate, bool bf16_products) {
  if (batch <= 0) return;
  std::vector<int64_t> ao(batch), bo(batch);
  for (int64_t i = 0; i < batch; ++i) {
    ao[i] = i * sa;
    bo[i] = i * sb;
  }
  GemmArgs args;
  args.dtype = dtype_v<T>;
  args.batch = batch;
  args.m = m;
  args.n = n;
  args.k = k;
  args.a = {a, ars, acs};
  args.b = {b, brs, bcs};
  args.a_off = ao.data();
  args.b_off = bo.data();
  args.c = c;
  args.ldc = n;
  args.accumulate = accumulate;
  args.bf16_products = bf16_products;
  cuda_kernels().gemm(args);
}

template <class T>
void conv_typed(ConvKind kind, const ConvGeom& g, const T* a, const T* b, const T* bias, T* out) {
  const Geom fg = flat(g);
  const int64_t og = g.og(), ckk = g.ckk(), L = g.L(), HW = g.H * g.W;
  const int64_t G = g.groups;
  if (kind == ConvKind::weight_grad) {
    const int64_t wsize = g.O * ckk;
    if (wsize == 0) return;
    // Every image's product accumulates into out, one image after another.
    QUANTA_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(T) * wsize, stream()));
  }
  if (g.N == 0) return;
  if (kind == ConvKind::forward && g.O * L == 0) return;
  if (kind == ConvKind::input_grad && g.C * HW == 0) return;

  const bool pw = g.pointwise();
  const int64_t per_image = pw ? 0 : g.C * g.kh * g.kw * L;  // = G ckk L
  int64_t chunk = g.N;
  if (per_image > 0)
    chunk = std::clamp<int64_t>(kColsBudget / (per_image * int64_t(sizeof(T))), 1, g.N);
  Scratch<T> scratch(chunk * per_image);
  T* cols = scratch.get();

  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t S = std::min(chunk, g.N - n0);
    if (kind == ConvKind::forward) {
      // y[n, group] [og, L] = w[group] [og, ckk] . cols[n, group] [ckk, L]
      const T* x = a + n0 * g.C * HW;
      T* y = out + n0 * g.O * L;
      if (!pw) launch_elements(S * per_image, im2col_kernel<T>, fg, x, cols);
      const T* src = pw ? x : cols;  // [S, G, ckk, L]
      if (bias) launch_elements(S * g.O * L, fill_channels_kernel<T>, g.O, L, bias, y);
      if (G == 1) {
        gemm_batch<T>(S, og, L, ckk, b, ckk, 1, 0, src, L, 1, ckk * L, y, bias != nullptr,
                      g.bf16_products);
      } else {
        for (int64_t s = 0; s < S; ++s)
          gemm_batch<T>(G, og, L, ckk, b, ckk, 1, og * ckk, src + s * G * ckk * L, L, 1, ckk * L,
                        y + s * g.O * L, bias != nullptr, g.bf16_products);
      }
    } else if (kind == ConvKind::input_grad) {
      // cols[n, group] [ckk, L] = w[group]^T [ckk, og] . g[n, group] [og, L],
      // then col2im; a pointwise kernel writes the image directly.
      const T* gy = a + n0 * g.O * L;
      T* x = out + n0 * g.C * HW;
      T* dst = pw ? x : cols;  // [S, G, ckk, L]
      const bool acc = pw && bias;
      if (acc) launch_elements(S * g.C * HW, fill_channels_kernel<T>, g.C, HW, bias, x);
      if (G == 1) {
        gemm_batch<T>(S, ckk, L, og, b, 1, ckk, 0, gy, L, 1, g.O * L, dst, acc, g.bf16_products);
      } else {
        for (int64_t s = 0; s < S; ++s)
          gemm_batch<T>(G, ckk, L, og, b, 1, ckk, og * ckk, gy + s * g.O * L, L, 1, og * L,
                        dst + s * G * ckk * L, acc, g.bf16_products);
      }
      if (!pw) launch_elements(S * g.C * HW, col2im_kernel<T>, fg, cols, bias, x);
    } else {
      // gw[group] [og, ckk] += g[n, group] [og, L] . cols[n, group]^T [L, ckk]
      const T* x = a + n0 * g.C * HW;
      const T* gy = b + n0 * g.O * L;
      if (!pw) launch_elements(S * per_image, im2col_kernel<T>, fg, x, cols);
      const T* src = pw ? x : cols;
      for (int64_t s = 0; s < S; ++s)
        gemm_batch<T>(G, og, ckk, L, gy + s * g.O * L, L, 1, og * L, src + s * G * ckk * L, 1, L,
                      ckk * L, out, true, g.bf16_products);
    }
  }
}

// A channels-last convolution cuDNN did not take: the activations it reads
// transposed to channels first, the im2col path run, and the activation it
// writes transposed back (the weight's layout is the same in both).
template <class T>
void conv_channels_last(ConvKind kind, const ConvGeom& g, const T* a, const T* b, const T* bias,
                        T* out) {
  ConvGeom first = g;
  first.channels_last = false;
  const int64_t in_px = g.H * g.W, out_px = g.OH * g.OW;
  // src [N, pixels, channels] -> dst [N, channels, pixels].
  auto to_planar = [&g](const T* src, int64_t channels, int64_t pixels, Scratch<T>& dst) {
    copy_transposed(copy, dtype_v<T>, g.N, pixels, channels, src, dst.get());
  };
  if (kind == ConvKind::weight_grad) {
    Scratch<T> x(g.N * g.C * in_px), gy(g.N * g.O * out_px);
    to_planar(a, g.C, in_px, x);
    to_planar(b, g.O, out_px, gy);
    conv_typed<T>(kind, first, x.get(), gy.get(), bias, out);
    return;
  }
  const bool fwd = kind == ConvKind::forward;
  const int64_t in_c = fwd ? g.C : g.O, in_p = fwd ? in_px : out_px;
  const int64_t out_c = fwd ? g.O : g.C, out_p = fwd ? out_px : in_px;
  Scratch<T> src(g.N * in_c * in_p), dst(g.N * out_c * out_p);
  to_planar(a, in_c, in_p, src);
  conv_typed<T>(kind, first, src.get(), b, bias, dst.get());
  copy_transposed(copy, dtype_v<T>, g.N, out_c, out_p, dst.get(), out);
}

}  // namespace

void conv(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
          const void* bias, void* out) {
  if (cudnn_conv(kind, dtype, g, a, b, bias, out)) return;
  dispatch_float(dtype, conv_op_name(kind), [&](auto tag) {
    using T = typename decltype(tag)::type;
    (g.channels_last ? conv_channels_last<T>
                     : conv_typed<T>)(kind, g, static_cast<const T*>(a), static_cast<const T*>(b),
                                      static_cast<const T*>(bias), static_cast<T*>(out));
  });
}

}  // namespace quanta::cuda
