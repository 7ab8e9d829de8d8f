// The CPU's convolution kernels (conv2d, its input gradient, which is
// conv_transpose2d, and its weight gradient): im2col + GEMM per image and
// group, col2im for the adjoint, whole images per thread when there are
// enough of them. engine/ops/conv.cpp validates and picks the geometry.
#include <algorithm>
#include <memory>

#include "engine/cpu/gemm.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"

namespace quanta::cpu {
namespace {

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
  parallel_for(
      0, g.ckk(), std::max<int64_t>(1, kGrainElements / std::max<int64_t>(L, 1)),
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
  parallel_for(
      0, g.cg(), std::max<int64_t>(1, kGrainElements / std::max<int64_t>(kk * L, 1)),
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
  parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      for (int64_t n = w * step; n < std::min(N, (w + 1) * step); ++n)
        body(n, buf ? buf + w * scratch : nullptr, w);
  });
}

// One kernel of `kind` on contiguous plain operands; `out` is uninitialised.
template <class T>
void conv_kernel(ConvKind kind, const T* a, const T* b, const T* bias, T* out,
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

  if (kind == ConvKind::forward) {
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
        gemm<T>(og, L, ckk, {w, ckk, 1}, {cols, L, 1}, y, L, bias != nullptr);
      }
    });
  } else if (kind == ConvKind::input_grad) {
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
          gemm<T>(cg, L, og, {w, 1, ckk}, {gy, L, 1}, x, L, bias != nullptr);
        } else {
          gemm<T>(ckk, L, og, {w, 1, ckk}, {gy, L, 1}, cols, L);
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
                      gemm<T>(og, ckk, L, {gy, L, 1}, {cols, 1, L},
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

}  // namespace

void conv(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
          const void* bias, void* out) {
  const char* op = conv_op_name(kind);
  dispatch_float(dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    conv_kernel<T>(kind, static_cast<const T*>(a), static_cast<const T*>(b),
                   static_cast<const T*>(bias), static_cast<T*>(out), g);
  });
}

}  // namespace quanta::cpu
