// CUDA entries group_norm and group_norm_grad (engine/kernels/table.h): a
// block per group for its sums (in f64, as the CPU's) and its elements, a
// thread per channel and piece of the batch for the affine gradients (pieces
// added in order: deterministic), the walk and per-element math from
// engine/kernels/group_norm.h.
#include <cuda_runtime.h>

#include <algorithm>

#include "engine/cuda/block_combine.cuh"
#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/cuda/scratch.h"
#include "engine/cuda/stream.h"
#include "engine/kernels/group_norm.h"

namespace quanta::cuda {
namespace {

template <class T>
__global__ void group_norm_kernel(NormGeom g, T eps, const T* x, const T* w, const T* b, T* y,
                                  T* mean, T* rstd) {
  const int64_t m = g.group_size();
  for (int64_t q = blockIdx.x; q < g.group_count(); q += gridDim.x) {
    const fn::GroupWalk walk = fn::group_walk(g, q);
    double sum = 0;
    fn::walk_share(walk, threadIdx.x, blockDim.x, [&](int64_t off, int64_t) { sum += x[off]; });
    const T mu = fn::norm_mean<T>(block_combine(sum, fn::Add{}), m);
    double sq = 0;
    fn::walk_share(walk, threadIdx.x, blockDim.x, [&](int64_t off, int64_t) {
      const double d = static_cast<double>(x[off]) - static_cast<double>(mu);
      sq += d * d;
    });
    const T r = fn::norm_rstd(fn::norm_mean<T>(block_combine(sq, fn::Add{}), m), eps);
    if (threadIdx.x == 0) mean[q] = mu, rstd[q] = r;
    fn::walk_share(walk, threadIdx.x, blockDim.x,
                   [&](int64_t off, int64_t c) { y[off] = fn::norm_out(x[off], mu, r, w, b, c); });
  }
}

template <class T>
__global__ void group_norm_input_grad_kernel(NormGeom g, const T* x, const T* w, const T* mean,
                                             const T* rstd, const T* gy, T* gx, bool accumulate) {
  const int64_t m = g.group_size();
  for (int64_t q = blockIdx.x; q < g.group_count(); q += gridDim.x) {
    const fn::GroupWalk walk = fn::group_walk(g, q);
    const T mu = mean[q], r = rstd[q];
    double sum_g = 0, sum_gx = 0;
    fn::walk_share(walk, threadIdx.x, blockDim.x, [&](int64_t off, int64_t c) {
      const T gs = fn::norm_scaled_grad(gy[off], w, c);
      sum_g += gs;
      sum_gx += static_cast<double>(gs) * static_cast<double>((x[off] - mu) * r);
    });
    const T mean_g = fn::norm_mean<T>(block_combine(sum_g, fn::Add{}), m);
    const T mean_gx = fn::norm_mean<T>(block_combine(sum_gx, fn::Add{}), m);
    fn::walk_share(walk, threadIdx.x, blockDim.x, [&](int64_t off, int64_t c) {
      const T v = fn::norm_grad_x(fn::norm_scaled_grad(gy[off], w, c), (x[off] - mu) * r, r, mean_g,
                                  mean_gx);
      gx[off] = accumulate ? gx[off] + v : v;
    });
  }
}

// The affine gradients of channel c over piece p of the batch (items
// p * piece onward, each item's spatial positions in order), a thread per
// (piece, channel): sums of gy xhat and gy into out[p * 2C + c] and
// out[p * 2C + C + c] (Out: f64 partial sums, or T for one piece, written
// to gw and gb directly).
template <class T, class Out>
__global__ void group_norm_affine_grad_kernel(NormGeom g, const T* x, const T* mean, const T* rstd,
                                              const T* gy, int64_t piece, int64_t pieces, Out* gw,
                                              Out* gb, int64_t out_stride) {
  const int64_t channels = g.channels, cg = g.group_channels();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < channels * pieces;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = e % channels, p = e / channels;
    const int64_t end = min(g.batch, (p + 1) * piece);
    double sum_gxhat = 0, sum_gy = 0;
    for (int64_t item = p * piece; item < end; ++item) {
      const int64_t q = item * g.groups + c / cg;
      const T mu = mean[q], r = rstd[q];
      for (int64_t s = 0; s < g.spatial; ++s) {
        const int64_t off = g.channels_last ? (item * g.spatial + s) * channels + c
                                            : (item * channels + c) * g.spatial + s;
        sum_gy += gy[off];
        sum_gxhat += static_cast<double>(gy[off]) * static_cast<double>((x[off] - mu) * r);
      }
    }
    if (gw) gw[p * out_stride + c] = static_cast<Out>(sum_gxhat);
    if (gb) gb[p * out_stride + c] = static_cast<Out>(sum_gy);
  }
}

// The pieces' partial sums, rows [gw's C | gb's C] per piece, added in piece
// order into gw and gb (either null: not wanted).
template <class T>
__global__ void sum_pieces_kernel(const double* partial, int64_t pieces, int64_t channels, T* gw,
                                  T* gb) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < 2 * channels;
       j += int64_t(gridDim.x) * blockDim.x) {
    T* out = j < channels ? gw : gb;
    if (!out) continue;
    double acc = 0;
    for (int64_t p = 0; p < pieces; ++p) acc += partial[p * 2 * channels + j];
    out[j % channels] = static_cast<T>(acc);
  }
}

unsigned group_blocks(const NormGeom& g) {
  return static_cast<unsigned>(std::min<int64_t>(g.group_count(), max_blocks()));
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(launch_config(n, max_blocks()).blocks);
}

}  // namespace

void group_norm(DType dtype, const NormGeom& g, double eps, const void* x, const void* w,
                const void* b, void* y, void* mean, void* rstd) {
  if (g.group_count() == 0) return;
  dispatch_float(dtype, "group_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    group_norm_kernel<T><<<group_blocks(g), kThreadsPerBlock, 0, stream()>>>(
        g, static_cast<T>(eps), static_cast<const T*>(x), static_cast<const T*>(w),
        static_cast<const T*>(b), static_cast<T*>(y), static_cast<T*>(mean), static_cast<T*>(rstd));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void group_norm_grad(DType dtype, const NormGeom& g, const void* x, const void* w, const void* mean,
                     const void* rstd, const void* gy, void* gx, void* gw, void* gb,
                     bool accumulate_gx) {
  dispatch_float(dtype, "group_norm backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* xt = static_cast<const T*>(x);
    const auto* mt = static_cast<const T*>(mean);
    const auto* rt = static_cast<const T*>(rstd);
    const auto* gt = static_cast<const T*>(gy);
    if (gx && g.group_count() > 0) {
      group_norm_input_grad_kernel<T><<<group_blocks(g), kThreadsPerBlock, 0, stream()>>>(
          g, xt, static_cast<const T*>(w), mt, rt, gt, static_cast<T*>(gx), accumulate_gx);
      QUANTA_CUDA_CHECK_LAUNCH();
    }
    if ((!gw && !gb) || g.channels == 0) return;
    // A thread per channel alone leaves most of a GPU idle, each thread
    // walking the whole batch: the batch is cut into pieces (as the grid
    // reductions cut a long column), summed per piece, then the pieces
    // added in order.
    const GridPieces cut = grid_pieces(g.channels, g.batch);
    const int64_t c = g.channels;
    if (cut.pieces == 1) {
      group_norm_affine_grad_kernel<T, T><<<blocks_for(c), kThreadsPerBlock, 0, stream()>>>(
          g, xt, mt, rt, gt, cut.piece, 1, static_cast<T*>(gw), static_cast<T*>(gb), c);
      QUANTA_CUDA_CHECK_LAUNCH();
      return;
    }
    // Rows [gw's C | gb's C] per piece.
    Scratch<double> partial(2 * c * cut.pieces);
    double* pw = gw ? partial.get() : nullptr;
    double* pb = gb ? partial.get() + c : nullptr;
    group_norm_affine_grad_kernel<T, double>
        <<<blocks_for(c * cut.pieces), kThreadsPerBlock, 0, stream()>>>(
            g, xt, mt, rt, gt, cut.piece, cut.pieces, pw, pb, 2 * c);
    QUANTA_CUDA_CHECK_LAUNCH();
    sum_pieces_kernel<T><<<blocks_for(2 * c), kThreadsPerBlock, 0, stream()>>>(
        partial.get(), cut.pieces, c, static_cast<T*>(gw), static_cast<T*>(gb));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::cuda
