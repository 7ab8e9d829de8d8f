// The CPU's pooling kernels: average pooling and its adjoint, max pooling
// with its argmax indices, the gather and scatter along those indices, and
// nearest 2x upsampling. Planes are split across threads, so no two threads
// write one element. engine/ops/pool.cpp validates and picks the geometry.
#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"

namespace quanta::cpu {
namespace {

int64_t plane_grain(int64_t plane_work) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(plane_work, 1));
}

template <class T>
void avg_kernel(bool adjoint, const PoolWindow& g, const T* in, T* o) {
  const T inv = T(1) / static_cast<T>(g.kernel[0] * g.kernel[1]);
  const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
  parallel_for(0, g.P, plane_grain(ohw * g.kernel[0] * g.kernel[1]), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const T* src = in + p * (adjoint ? ohw : hw);
      T* dst = o + p * (adjoint ? hw : ohw);
      if (adjoint) std::fill(dst, dst + hw, T(0));
      for (int64_t oh = 0; oh < g.OH; ++oh) {
        const int64_t h0 = oh * g.stride[0] - g.padding[0];
        const int64_t hlo = std::max<int64_t>(h0, 0), hhi = std::min(h0 + g.kernel[0], g.H);
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          const int64_t w0 = ow * g.stride[1] - g.padding[1];
          const int64_t wlo = std::max<int64_t>(w0, 0), whi = std::min(w0 + g.kernel[1], g.W);
          if (adjoint) {
            const T v = src[oh * g.OW + ow] * inv;
            for (int64_t ih = hlo; ih < hhi; ++ih)
              for (int64_t iw = wlo; iw < whi; ++iw) dst[ih * g.W + iw] += v;
          } else {
            T s = 0;
            for (int64_t ih = hlo; ih < hhi; ++ih)
              for (int64_t iw = wlo; iw < whi; ++iw) s += src[ih * g.W + iw];
            dst[oh * g.OW + ow] = s * inv;
          }
        }
      }
    }
  });
}

template <class T>
void max_kernel(const PoolWindow& g, const T* in, T* o, int64_t* ix) {
  const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
  parallel_for(0, g.P, plane_grain(ohw * g.kernel[0] * g.kernel[1]), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const T* src = in + p * hw;
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          T best = -std::numeric_limits<T>::infinity();
          int64_t arg = -1;
          for (int64_t i = 0; i < g.kernel[0]; ++i) {
            const int64_t ih = oh * g.stride[0] - g.padding[0] + i * g.dilation[0];
            if (ih < 0 || ih >= g.H) continue;
            for (int64_t j = 0; j < g.kernel[1]; ++j) {
              const int64_t iw = ow * g.stride[1] - g.padding[1] + j * g.dilation[1];
              if (iw < 0 || iw >= g.W) continue;
              const T v = src[ih * g.W + iw];
              // Like PyTorch: the first maximum wins; NaN propagates.
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
}

template <class T>
void gather_kernel(const PoolWindow& g, const int64_t* ix, const T* in, T* o) {
  const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
  parallel_for(0, g.P, plane_grain(ohw), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t i = p * ohw; i < (p + 1) * ohw; ++i)
        o[i] = ix[i] >= 0 ? in[p * hw + ix[i]] : T(0);
  });
}

template <class T>
void scatter_kernel(const PoolWindow& g, const int64_t* ix, const T* in, T* o) {
  const int64_t hw = g.H * g.W, ohw = g.OH * g.OW;
  parallel_for(0, g.P, plane_grain(ohw + hw), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      T* dst = o + p * hw;
      std::fill(dst, dst + hw, T(0));
      for (int64_t i = p * ohw; i < (p + 1) * ohw; ++i)
        if (ix[i] >= 0) dst[ix[i]] += in[i];
    }
  });
}

}  // namespace

void avg_pool(bool adjoint, DType dtype, const PoolWindow& g, const void* in, void* out) {
  dispatch_float(dtype, adjoint ? "avg_pool2d_backward" : "avg_pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    avg_kernel<T>(adjoint, g, static_cast<const T*>(in), static_cast<T*>(out));
  });
}

void max_pool(DType dtype, const PoolWindow& g, const void* in, void* out, int64_t* indices) {
  dispatch_float(dtype, "max_pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    max_kernel<T>(g, static_cast<const T*>(in), static_cast<T*>(out), indices);
  });
}

void max_pool_route(bool scatter, DType dtype, const PoolWindow& g, const int64_t* indices,
                    const void* in, void* out) {
  dispatch_float(dtype, scatter ? "max_pool2d_backward" : "max_pool2d_gather", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (scatter)
      scatter_kernel<T>(g, indices, static_cast<const T*>(in), static_cast<T*>(out));
    else
      gather_kernel<T>(g, indices, static_cast<const T*>(in), static_cast<T*>(out));
  });
}

void upsample_nearest2x(DType dtype, int64_t rows, int64_t W, const void* in, void* out) {
  dispatch_all(dtype, "interpolate_nearest2x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* src = static_cast<const T*>(in);
    T* dst = static_cast<T*>(out);
    parallel_for(0, rows, plane_grain(4 * W), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        // Input row r becomes output rows 2r and 2r + 1 (planes stack rows).
        const T* s = src + r * W;
        T* d = dst + 2 * r * 2 * W;
        for (int64_t j = 0; j < W; ++j) d[2 * j] = d[2 * j + 1] = s[j];
        std::copy(d, d + 2 * W, d + 2 * W);
      }
    });
  });
}

}  // namespace quanta::cpu
