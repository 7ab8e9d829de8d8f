// The CPU's group normalisation entries (group_norm, group_norm_grad): a
// group's sums in f64 over its walk (engine/kernels/group_norm.h), the
// per-element math from the same header as CUDA's, groups and channels
// spread over threads.
#include <algorithm>
#include <cstdint>

#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/kernels/group_norm.h"

namespace quanta::cpu {
namespace {

// Chunks of `count` items of `each` elements: one thread below kGrainElements.
int64_t grain_of(int64_t each) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(each, 1));
}

// The offset of channel c's element at batch item `item`, spatial s.
int64_t element_at(const NormGeom& g, int64_t item, int64_t c, int64_t s) {
  return g.channels_last ? (item * g.spatial + s) * g.channels + c
                         : (item * g.channels + c) * g.spatial + s;
}

}  // namespace

void group_norm(DType dtype, const NormGeom& g, double eps, const void* x, const void* w,
                const void* b, void* y, void* mean, void* rstd) {
  dispatch_float(dtype, "group_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x);
    const T* ws = static_cast<const T*>(w);
    const T* bs = static_cast<const T*>(b);
    T* ys = static_cast<T*>(y);
    const int64_t m = g.group_size();
    parallel_for(0, g.group_count(), grain_of(m), [&](int64_t lo, int64_t hi) {
      for (int64_t q = lo; q < hi; ++q) {
        const fn::GroupWalk walk = fn::group_walk(g, q);
        double sum = 0;
        fn::walk_share(walk, 0, 1, [&](int64_t off, int64_t) { sum += xs[off]; });
        const T mu = fn::norm_mean<T>(sum, m);
        double sq = 0;
        fn::walk_share(walk, 0, 1, [&](int64_t off, int64_t) {
          const double d = static_cast<double>(xs[off]) - static_cast<double>(mu);
          sq += d * d;
        });
        const T r = fn::norm_rstd(fn::norm_mean<T>(sq, m), static_cast<T>(eps));
        static_cast<T*>(mean)[q] = mu;
        static_cast<T*>(rstd)[q] = r;
        fn::walk_share(walk, 0, 1, [&](int64_t off, int64_t c) {
          ys[off] = fn::norm_out(xs[off], mu, r, ws, bs, c);
        });
      }
    });
  });
}

void group_norm_grad(DType dtype, const NormGeom& g, const void* x, const void* w, const void* mean,
                     const void* rstd, const void* gy, void* gx, void* gw, void* gb,
                     bool accumulate_gx) {
  dispatch_float(dtype, "group_norm backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x);
    const T* ws = static_cast<const T*>(w);
    const T* mus = static_cast<const T*>(mean);
    const T* rs = static_cast<const T*>(rstd);
    const T* gys = static_cast<const T*>(gy);
    const int64_t m = g.group_size();
    if (gx) {
      T* out = static_cast<T*>(gx);
      parallel_for(0, g.group_count(), grain_of(m), [&](int64_t lo, int64_t hi) {
        for (int64_t q = lo; q < hi; ++q) {
          const fn::GroupWalk walk = fn::group_walk(g, q);
          const T mu = mus[q], r = rs[q];
          double sum_g = 0, sum_gx = 0;
          fn::walk_share(walk, 0, 1, [&](int64_t off, int64_t c) {
            const T gs = fn::norm_scaled_grad(gys[off], ws, c);
            sum_g += gs;
            sum_gx += static_cast<double>(gs) * static_cast<double>((xs[off] - mu) * r);
          });
          const T mean_g = fn::norm_mean<T>(sum_g, m), mean_gx = fn::norm_mean<T>(sum_gx, m);
          fn::walk_share(walk, 0, 1, [&](int64_t off, int64_t c) {
            const T v = fn::norm_grad_x(fn::norm_scaled_grad(gys[off], ws, c), (xs[off] - mu) * r,
                                        r, mean_g, mean_gx);
            out[off] = accumulate_gx ? out[off] + v : v;
          });
        }
      });
    }
    if (!gw && !gb) return;
    // A channel's sums over the batch in order, then its spatial positions.
    const int64_t cg = g.group_channels();
    parallel_for(0, g.channels, grain_of(g.batch * g.spatial), [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        double sum_gxhat = 0, sum_gy = 0;
        for (int64_t item = 0; item < g.batch; ++item) {
          const int64_t q = item * g.groups + c / cg;
          for (int64_t s = 0; s < g.spatial; ++s) {
            const int64_t off = element_at(g, item, c, s);
            sum_gy += gys[off];
            sum_gxhat +=
                static_cast<double>(gys[off]) * static_cast<double>((xs[off] - mus[q]) * rs[q]);
          }
        }
        if (gw) static_cast<T*>(gw)[c] = static_cast<T>(sum_gxhat);
        if (gb) static_cast<T*>(gb)[c] = static_cast<T>(sum_gy);
      }
    });
  });
}

}  // namespace quanta::cpu
