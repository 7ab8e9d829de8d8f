// The CPU's convolution kernels (conv2d, its input gradient, which is
// conv_transpose2d, and its weight gradient). f32 layers that oneDNN serves
// run through it (conv_onednn.h); the rest here: im2col + GEMM over chunks of
// images side by side, col2im for the adjoint, whole chunks per thread when
// there are enough images. Layers with a few channels or more run channels
// last (conv_channels_last.cpp); this file holds the planar path that the
// rest (one or two channels, groups) takes; channels-last activations
// always take the channels-last path. engine/ops/conv.cpp validates
// and picks the geometry.
#include <algorithm>
#include <memory>
#include <type_traits>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/conv_channels_last.h"
#include "engine/cpu/conv_chunks.h"
#include "engine/cpu/conv_direct.h"
#include "engine/cpu/conv_onednn.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"

namespace quanta::cpu {
namespace {

// cols [Cg kh kw, OH OW] (row stride ld) from one group of one image
// x [Cg, H, W]. Inside a parallel region the rows run on the calling thread.
template <class T>
void im2col(const T* x, T* cols, int64_t ld, const ConvGeom& g) {
  const int64_t L = g.L(), kk = g.kh * g.kw;
  parallel_for(0, g.ckk(), std::max<int64_t>(1, kGrainElements / std::max<int64_t>(L, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t r = lo; r < hi; ++r) {
                   const int64_t c = r / kk, i = (r / g.kw) % g.kh, j = r % g.kw;
                   const T* plane = x + c * g.H * g.W;
                   const int64_t dh = i * g.dilation[0] - g.padding[0],
                                 dw = j * g.dilation[1] - g.padding[1];
                   int64_t ow_lo, ow_hi;
                   valid_range(dw, g.stride[1], g.W, g.OW, ow_lo, ow_hi);
                   T* dst = cols + r * ld;
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

// x [Cg, H, W] += col2im(cols) (cols' row stride ld): the adjoint of im2col.
// Channels are split across threads, so no two threads write one pixel.
template <class T>
void col2im(const T* cols, int64_t ld, T* x, const ConvGeom& g) {
  const int64_t L = g.L(), kk = g.kh * g.kw;
  parallel_for(0, g.cg(), std::max<int64_t>(1, kGrainElements / std::max<int64_t>(kk * L, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t c = lo; c < hi; ++c) {
                   T* plane = x + c * g.H * g.W;
                   for (int64_t i = 0; i < g.kh; ++i)
                     for (int64_t j = 0; j < g.kw; ++j) {
                       const int64_t dh = i * g.dilation[0] - g.padding[0];
                       const int64_t dw = j * g.dilation[1] - g.padding[1];
                       int64_t ow_lo, ow_hi;
                       valid_range(dw, g.stride[1], g.W, g.OW, ow_lo, ow_hi);
                       const T* src = cols + ((c * g.kh + i) * g.kw + j) * ld;
                       for (int64_t oh = 0; oh < g.OH; ++oh, src += g.OW) {
                         const int64_t ih = oh * g.stride[0] + dh;
                         if (ih < 0 || ih >= g.H) continue;
                         T* row = plane + ih * g.W;
                         if (g.stride[1] == 1) {
                           T* dst = row + dw;
                           for (int64_t ow = ow_lo; ow < ow_hi; ++ow) dst[ow] += src[ow];
                         } else {
                           for (int64_t ow = ow_lo; ow < ow_hi; ++ow)
                             row[ow * g.stride[1] + dw] += src[ow];
                         }
                       }
                     }
                 }
               });
}

// dst [rows, nb * L] (image j's block at column j * L) from `nb` images of
// src whose blocks of [rows, L] lie `image_stride` apart. The GEMMs' view
// of a chunk of NCHW activations.
template <class T>
void gather_images(const T* src, int64_t image_stride, int64_t nb, int64_t rows, int64_t L,
                   T* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < nb; ++j)
      std::copy(src + j * image_stride + r * L, src + j * image_stride + (r + 1) * L,
                dst + (r * nb + j) * L);
}

// One kernel of `kind` on contiguous plain NCHW operands, im2col in the
// planar layout (rows of one channel's pixels); `out` is uninitialised.
// N > 0 (conv() answers an empty batch).
template <class T>
void conv_planar(ConvKind kind, const T* a, const T* b, const T* bias, T* out, const ConvGeom& g) {
  const int64_t cg = g.cg(), og = g.og(), ckk = g.ckk(), L = g.L(), HW = g.H * g.W;
  // A one-image chunk (a single image, or images too large to pair) reads
  // and writes the NCHW tensors in place instead of through a gathered copy.
  const Chunks plan = plan_chunks(g, std::max(ckk, og) * L);
  const int64_t cols_size = ckk * plan.images * L;
  const int64_t rows_size = plan.images > 1 ? og * plan.images * L : 0;
  // Per worker: the chunk's columns and its [og, images * L] block of the
  // output (forward) or of the output gradient (both backwards).
  const ScratchBuffer scratch(sizeof(T) * plan.workers * (cols_size + rows_size));
  auto cols_of = [&](int64_t w) { return scratch.as<T>() + w * (cols_size + rows_size); };
  auto rows_of = [&](int64_t w) { return cols_of(w) + cols_size; };

  if (kind == ConvKind::forward) {
    // y[chunk, group] [og, nb L] = w[group] [og, ckk] . cols [ckk, nb L]
    run_chunks(g, plan, [&](int64_t n0, int64_t nb, int64_t worker) {
      T* cols = cols_of(worker);
      T* y = rows_of(worker);
      const int64_t ld = nb * L;
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        for (int64_t j = 0; j < nb; ++j)
          im2col(a + ((n0 + j) * g.C + gi * cg) * HW, cols + j * L, ld, g);
        if (nb == 1) {  // straight into the output, on top of the bias
          T* yn = out + (n0 * g.O + gi * og) * L;
          for (int64_t o = 0; o < og && bias; ++o)
            std::fill(yn + o * L, yn + (o + 1) * L, bias[gi * og + o]);
          gemm<T>(og, L, ckk, {b + gi * og * ckk, ckk, 1}, {cols, L, 1}, yn, L, bias != nullptr,
                  g.bf16_products);
          continue;
        }
        gemm<T>(og, ld, ckk, {b + gi * og * ckk, ckk, 1}, {cols, ld, 1}, y, ld, false,
                g.bf16_products);
        for (int64_t j = 0; j < nb; ++j)
          for (int64_t o = 0; o < og; ++o) {
            const T* src = y + o * ld + j * L;
            T* dst = out + ((n0 + j) * g.O + gi * og + o) * L;
            const T shift = bias ? bias[gi * og + o] : T(0);
            for (int64_t l = 0; l < L; ++l) dst[l] = src[l] + shift;
          }
      }
    });
  } else if (kind == ConvKind::input_grad) {
    // cols [ckk, nb L] = w[group]^T [ckk, og] . g[chunk, group] [og, nb L],
    // then col2im into each image.
    run_chunks(g, plan, [&](int64_t n0, int64_t nb, int64_t worker) {
      T* cols = cols_of(worker);
      T* gy = rows_of(worker);
      const int64_t ld = nb * L;
      for (int64_t j = 0; j < nb; ++j) {
        T* xn = out + (n0 + j) * g.C * HW;
        for (int64_t c = 0; c < g.C; ++c)
          std::fill(xn + c * HW, xn + (c + 1) * HW, bias ? bias[c] : T(0));
      }
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        const T* gyc = a + (n0 * g.O + gi * og) * L;
        if (nb > 1) gather_images(gyc, g.O * L, nb, og, L, gy);
        gemm<T>(ckk, ld, og, {b + gi * og * ckk, 1, ckk}, {nb > 1 ? gy : gyc, ld, 1}, cols, ld,
                false, g.bf16_products);
        for (int64_t j = 0; j < nb; ++j)
          col2im(cols + j * L, ld, out + ((n0 + j) * g.C + gi * cg) * HW, g);
      }
    });
  } else {
    // gw[group] [og, ckk] += g[chunk, group] [og, nb L] . cols^T [nb L, ckk],
    // one partial sum per worker.
    const int64_t wsize = g.O * ckk;
    std::unique_ptr<T[]> partial(plan.workers > 1 ? new T[plan.workers * wsize] : nullptr);
    T* acc0 = plan.workers > 1 ? partial.get() : out;
    std::fill(acc0, acc0 + plan.workers * wsize, T(0));
    run_chunks(g, plan, [&](int64_t n0, int64_t nb, int64_t worker) {
      T* cols = cols_of(worker);
      T* gy = rows_of(worker);
      T* acc = acc0 + worker * wsize;
      const int64_t ld = nb * L;
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        for (int64_t j = 0; j < nb; ++j)
          im2col(a + ((n0 + j) * g.C + gi * cg) * HW, cols + j * L, ld, g);
        const T* gyc = b + (n0 * g.O + gi * og) * L;
        if (nb > 1) gather_images(gyc, g.O * L, nb, og, L, gy);
        gemm<T>(og, ckk, ld, {nb > 1 ? gy : gyc, ld, 1}, {cols, 1, ld}, acc + gi * og * ckk, ckk,
                true, g.bf16_products);
      }
    });
    if (plan.workers > 1) {
      std::copy(acc0, acc0 + wsize, out);
      for (int64_t w = 1; w < plan.workers; ++w)
        for (int64_t i = 0; i < wsize; ++i) out[i] += acc0[w * wsize + i];
    }
  }
}

}  // namespace

void conv(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
          const void* bias, void* out) {
  const char* op = conv_op_name(kind);
  dispatch_float(dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* pa = static_cast<const T*>(a);
    const auto* pb = static_cast<const T*>(b);
    const auto* pbias = static_cast<const T*>(bias);
    if (g.N == 0) {  // no images: a weight gradient of zeros, else nothing to write
      if (kind == ConvKind::weight_grad)
        std::fill(static_cast<T*>(out), static_cast<T*>(out) + g.O * g.ckk(), T(0));
      return;
    }
    if constexpr (std::is_same_v<T, float>)
      if (conv_onednn(kind, g, pa, pb, pbias, static_cast<T*>(out))) return;
    const bool direct = std::is_same_v<T, float> && conv_direct_serves(kind, g);
    if (direct || g.channels_last || channels_last_pays(g))
      conv_channels_last<T>(kind, pa, pb, pbias, static_cast<T*>(out), g, direct);
    else
      conv_planar<T>(kind, pa, pb, pbias, static_cast<T*>(out), g);
  });
}

}  // namespace quanta::cpu
