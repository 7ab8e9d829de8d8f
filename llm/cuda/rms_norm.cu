// CUDA entries rms_norm and rms_norm_grad (llm/kernels/table.h): a warp per
// row for the row sums, a thread per column and piece of the rows for the
// weight's gradient (pieces added in order), the per-element math from
// llm/kernels/functors.h.
#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

template <class T, class A>
__global__ void rms_norm_kernel(const T* x, const T* w, int64_t rows, int64_t n, A eps,
                                RmsWeight how, T* y, A* inv_rms) {
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(r, rows) {
    const T* xr = x + r * n;
    A sum_sq = 0;
    for (int64_t j = lane; j < n; j += kWarp) {
      const A v = static_cast<A>(xr[j]);
      sum_sq += v * v;
    }
    const A scale = fn::rms_scale<A>(warp_sum(sum_sq), n, eps);
    if (lane == 0) inv_rms[r] = scale;
    for (int64_t j = lane; j < n; j += kWarp)
      y[r * n + j] = fn::rms_out<T, A>(xr[j], w[j], scale, how);
  }
}

template <class T, class A>
__global__ void rms_norm_input_grad_kernel(const T* x, const T* w, RmsWeight how, const A* inv_rms,
                                           const T* gy, int64_t rows, int64_t n, T* gx,
                                           bool accumulate) {
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(r, rows) {
    const T* xr = x + r * n;
    const T* gr = gy + r * n;
    A dot = 0;
    for (int64_t j = lane; j < n; j += kWarp)
      dot += static_cast<A>(gr[j]) * fn::rms_factor<T, A>(w[j], how) * static_cast<A>(xr[j]);
    const A c = warp_sum(dot) / static_cast<A>(n);
    const A scale = inv_rms[r];
    for (int64_t j = lane; j < n; j += kWarp) {
      const A v = fn::rms_grad_x<A>(
          static_cast<A>(xr[j]), static_cast<A>(gr[j]) * fn::rms_factor<T, A>(w[j], how), scale, c);
      gx[r * n + j] = static_cast<T>(accumulate ? static_cast<A>(gx[r * n + j]) + v : v);
    }
  }
}

// The weight's gradient over piece p of the rows (rows p * piece onward, in
// order), a thread per (piece, column): into out[p * n + j] (Out: the
// accumulation type for the pieces' partial sums, T for one piece).
template <class T, class A, class Out>
__global__ void rms_norm_weight_grad_kernel(const T* x, const A* inv_rms, const T* gy, int64_t rows,
                                            int64_t n, int64_t piece, int64_t pieces, Out* out) {
  QUANTA_GRID_STRIDE(e, n * pieces) {
    const int64_t j = e % n, p = e / n;
    const int64_t r1 = min(rows, (p + 1) * piece);
    A acc = 0;
    for (int64_t r = p * piece; r < r1; ++r)
      acc += static_cast<A>(gy[r * n + j]) * static_cast<A>(x[r * n + j]) * inv_rms[r];
    out[e] = static_cast<Out>(acc);
  }
}

// The pieces' partial sums [pieces, n] added in piece order into gw.
template <class T, class A>
__global__ void sum_pieces_kernel(const A* partial, int64_t pieces, int64_t n, T* gw) {
  QUANTA_GRID_STRIDE(j, n) {
    A acc = 0;
    for (int64_t p = 0; p < pieces; ++p) acc += partial[p * n + j];
    gw[j] = static_cast<T>(acc);
  }
}

unsigned blocks_of(const cuda::LaunchConfig& g) { return static_cast<unsigned>(g.blocks); }

}  // namespace

void rms_norm(DType dtype, const void* x, const void* weight, int64_t rows, int64_t n, double eps,
              RmsWeight how, void* y, void* inv_rms) {
  dispatch_llm(dtype, "rms_norm", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig g = warp_grid_for(rows);
    if (g.blocks == 0 || n == 0) return;
    rms_norm_kernel<T, A><<<blocks_of(g), g.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), rows, n, static_cast<A>(eps), how,
        static_cast<T*>(y), static_cast<A*>(inv_rms));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void rms_norm_grad(DType dtype, const void* x, const void* weight, RmsWeight how,
                   const void* inv_rms, const void* gy, int64_t rows, int64_t n, void* gx, void* gw,
                   bool accumulate_gx) {
  dispatch_llm(dtype, "rms_norm backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig g = warp_grid_for(rows);
    if (gx && g.blocks > 0 && n > 0) {
      rms_norm_input_grad_kernel<T, A><<<blocks_of(g), g.threads, 0, cuda::stream()>>>(
          static_cast<const T*>(x), static_cast<const T*>(weight), how,
          static_cast<const A*>(inv_rms), static_cast<const T*>(gy), rows, n, static_cast<T*>(gx),
          accumulate_gx);
      QUANTA_CUDA_CHECK_LAUNCH();
    }
    if (!gw || n == 0) return;
    const auto* xt = static_cast<const T*>(x);
    const auto* ir = static_cast<const A*>(inv_rms);
    const auto* gt = static_cast<const T*>(gy);
    // A thread per column alone is a few blocks on a GPU of 132
    // multiprocessors, each thread walking every row: the rows are cut
    // into pieces (as the grid reductions cut a long column), summed per
    // piece, then the pieces added in order. Deterministic either way.
    const cuda::GridPieces cut = cuda::grid_pieces(n, rows);
    const cuda::LaunchConfig columns = grid_for(n);
    if (cut.pieces == 1) {
      rms_norm_weight_grad_kernel<T, A, T>
          <<<blocks_of(columns), columns.threads, 0, cuda::stream()>>>(
              xt, ir, gt, rows, n, cut.piece, 1, static_cast<T*>(gw));
      QUANTA_CUDA_CHECK_LAUNCH();
      return;
    }
    cuda::Scratch<A> partial(n * cut.pieces);
    const cuda::LaunchConfig pieces = grid_for(n * cut.pieces);
    rms_norm_weight_grad_kernel<T, A, A><<<blocks_of(pieces), pieces.threads, 0, cuda::stream()>>>(
        xt, ir, gt, rows, n, cut.piece, cut.pieces, partial.get());
    QUANTA_CUDA_CHECK_LAUNCH();
    sum_pieces_kernel<T, A><<<blocks_of(columns), columns.threads, 0, cuda::stream()>>>(
        partial.get(), cut.pieces, n, static_cast<T*>(gw));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::llm::llm_cuda
