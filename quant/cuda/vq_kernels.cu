// CUDA entries nearest_codes, squared_error(_mean, _coefficient, _grad),
// route_grad, dead_code_picks, replace_codes and the codebook
// EMA's ema_lerp and ema_embed (quant/kernels/table.h). The math is
// quant/kernels/functors.h; here only index arithmetic, cuBLAS for the
// distances, warp reductions and CUB's block scan.
#include <cub/block/block_scan.cuh>
#include <vector>

#include "quant/cuda/device.cuh"
#include "quant/cuda/kernels.h"
#include "quant/kernels/functors.h"

namespace quanta::quant::quant_cuda {
namespace {

// ---- nearest_codes ----

// bias [k] = |c_j|^2, a warp per code: the lanes read the code's row
// together (a thread per code would read 32 rows a row apart per load) and
// add their partial sums in a fixed order, so the bits do not change from
// run to run. (The GEMM beside it sums in cuBLAS's order anyway: scores are
// not the CPU's bits, only its indices where distances are not near-ties.)
template <class T>
__global__ void code_sq_norms(const T* c, int64_t k, int64_t d, T* bias) {
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(j, k) {
    T s = T(0);
    for (int64_t e = lane; e < d; e += kWarp) s += c[j * d + e] * c[j * d + e];
    s = warp_sum(s);
    if (lane == 0) bias[j] = s;
  }
}

// Each row's argmin of bias[c0 + j] + scores[i, j] (bias null: 0) over one
// code tile, merged into its running best; on the last tile the winner goes
// to out. The bias is added here, not by the GEMM, to save a pass.
template <class T>
__global__ void tile_argmin(const T* scores, const T* bias, int64_t rows, int64_t kc, int64_t c0,
                            bool first, bool last, fn::ArgMin<T>* best, int64_t* out) {
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(i, rows) {
    fn::ArgMin<T> a =
        fn::argmin_lane_scan(scores + i * kc, bias ? bias + c0 : nullptr, kc, c0, lane, kWarp);
    for (int o = kWarp / 2; o > 0; o /= 2) {
      fn::ArgMin<T> b;
      b.value = __shfl_xor_sync(0xffffffffu, a.value, o);
      b.index = __shfl_xor_sync(0xffffffffu, a.index, o);
      a = fn::argmin_merge(a, b);
    }
    if (lane == 0) {
      if (!first) a = fn::argmin_merge(best[i], a);
      if (last)
        out[i] = fn::argmin_result(a);
      else
        best[i] = a;
    }
  }
}

template <class T>
void nearest(const T* x, const T* c, int64_t n, int64_t k, int64_t d, bool cosine, int64_t* out) {
  const NearestTiles tiles = nearest_tiles(n, k);
  if (tiles.rows == 0) return;
  Scratch<T> bias(cosine ? 0 : k);
  Scratch<T> scores(tiles.rows * tiles.codes);
  Scratch<fn::ArgMin<T>> best(tiles.rows);
  if (!cosine) {
    const cuda::LaunchConfig g = warp_grid_for(k);
    code_sq_norms<T>
        <<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(c, k, d, bias.get());
    QUANTA_CUDA_CHECK_LAUNCH();
  }
  for (int64_t r0 = 0; r0 < n; r0 += tiles.rows) {
    const int64_t rows = std::min(tiles.rows, n - r0);
    for (int64_t c0 = 0; c0 < k; c0 += tiles.codes) {
      const int64_t kc = std::min(tiles.codes, k - c0);
      // scores^T [kc, rows] (column-major, ld kc) = -2 c_tile x_tile^T: the
      // row-major tiles read as column-major [d, kc] and [d, rows].
      if (d > 0)
        gemm<T>(CUBLAS_OP_T, CUBLAS_OP_N, kc, rows, d, T(-2), c + c0 * d, d, x + r0 * d, d, T(0),
                scores.get(), kc);
      else
        QUANTA_CUDA_CHECK(cudaMemsetAsync(scores.get(), 0, sizeof(T) * rows * kc, cuda::stream()));
      const cuda::LaunchConfig ga = warp_grid_for(rows);
      tile_argmin<T><<<static_cast<unsigned>(ga.blocks), ga.threads, 0, cuda::stream()>>>(
          scores.get(), bias.get(), rows, kc, c0, c0 == 0, c0 + kc >= k, best.get(), out + r0);
      QUANTA_CUDA_CHECK_LAUNCH();
    }
  }
}

// ---- squared_error: one block per 256-row chunk, a warp per row ----

struct Partial {
  double total;
  double rows;
};

template <class T>
__global__ void chunk_sums(const T* x, const T* q, const uint8_t* valid, int64_t rows, int64_t d,
                           Partial* partial) {
  constexpr int kWarps = cuda::kThreadsPerBlock / kWarp;
  __shared__ double warp_total[kWarps];
  __shared__ double warp_rows[kWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSquaredErrorChunk;
  const int64_t end = begin + kSquaredErrorChunk < rows ? begin + kSquaredErrorChunk : rows;
  double total = 0, counted = 0;
  for (int64_t r = begin + warp; r < end; r += kWarps) {
    if (valid && valid[r] == 0) continue;
    T s = T(0);
    for (int64_t e = lane; e < d; e += kWarp)
      s += (x[r * d + e] - q[r * d + e]) * (x[r * d + e] - q[r * d + e]);
    total += static_cast<double>(warp_sum(s));
    counted += valid ? static_cast<double>(valid[r]) : 1.0;
  }
  if (lane == 0) warp_total[warp] = total, warp_rows[warp] = counted;
  __syncthreads();
  if (threadIdx.x == 0) {
    Partial p{0, 0};
    for (int w = 0; w < kWarps; ++w) p.total += warp_total[w], p.rows += warp_rows[w];
    partial[blockIdx.x] = p;
  }
}

// The chunks' partial sums added in order, as the CPU does, by one thread:
// the result stays on the device.
__global__ void finish_sums(const Partial* partial, int64_t chunks, int64_t d, double* out) {
  double total = 0, rows = 0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c].total, rows += partial[c].rows;
  out[0] = total;
  out[1] = rows * static_cast<double>(d);
}

// ---- squared_error_grad, the straight route ----

template <class T>
__global__ void commit_grad_kernel(const T* x, const T* q, const uint8_t* valid, int64_t rows,
                                   int64_t d, const double* scale_on_device, T* gx) {
  const T scale = static_cast<T>(*scale_on_device);
  QUANTA_GRID_STRIDE(i, rows * d) {
    gx[i] = valid && valid[i / d] == 0 ? T(0) : fn::commit_grad(scale, x[i], q[i]);
  }
}

// The commitment term's weight of row r (valid null: coef itself).
template <class T>
__device__ T commit_weight(T coef, const uint8_t* valid, int64_t r) {
  return valid && coef != T(0) ? coef * static_cast<T>(valid[r]) : coef;
}

// The commitment coefficient, one f64 on the device, or 0 without one.
template <class T>
__device__ T commit_coef(const double* coef) {
  return coef ? static_cast<T>(*coef) : T(0);
}

template <class T>
__global__ void straight_kernel(const T* x, const T* q, const T* g, const uint8_t* valid,
                                const double* coef_on_device, int64_t rows, int64_t d, T* gx) {
  const T coef = commit_coef<T>(coef_on_device);
  QUANTA_GRID_STRIDE(i, rows * d) {
    gx[i] = fn::straight_grad(g[i], commit_weight(coef, valid, i / d), x[i], q[i]);
  }
}

template <class T>
__global__ void rotation_kernel(const T* x, const T* q, const T* g, const uint8_t* valid,
                                const double* coef_on_device, int64_t rows, int64_t d, T* gx) {
  const T coef = commit_coef<T>(coef_on_device);
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(r, rows) {
    const T *xr = x + r * d, *qr = q + r * d, *gr = g + r * d;
    T xx = T(0), qq = T(0);
    for (int64_t e = lane; e < d; e += kWarp) xx += xr[e] * xr[e], qq += qr[e] * qr[e];
    xx = warp_sum(xx);
    qq = warp_sum(qq);
    const fn::RotationNorms<T> nm = fn::rotation_norms(xx, qq);
    T ww = T(0), gu = T(0), gq = T(0);
    for (int64_t e = lane; e < d; e += kWarp) {
      const T u = xr[e] * nm.ix, qh = qr[e] * nm.iq;
      ww += (u + qh) * (u + qh);
      gu += gr[e] * u;
      gq += gr[e] * qh;
    }
    const fn::RotationCoeffs<T> cf =
        fn::rotation_coeffs(qq, nm, warp_sum(ww), warp_sum(gu), warp_sum(gq));
    const T cc = commit_weight(coef, valid, r);
    for (int64_t e = lane; e < d; e += kWarp)
      gx[r * d + e] = fn::rotation_grad(xr[e], qr[e], gr[e], nm, cf, cc);
  }
}

// dead_code_picks: one block; each thread takes a run of consecutive codes,
// counts its expired ones, and a block scan gives each run the number of
// expired codes before it.
constexpr int kPickThreads = 1024;

template <class T>
__global__ void __launch_bounds__(kPickThreads)
    dead_code_picks_kernel(const T* size, int64_t k, T limit, const int64_t* draws,
                           int64_t* picks) {
  using Scan = cub::BlockScan<int64_t, kPickThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t per = (k + kPickThreads - 1) / kPickThreads;
  const int64_t begin = min(k, per * static_cast<int64_t>(threadIdx.x)), end = min(k, begin + per);
  int64_t mine = 0;
  for (int64_t c = begin; c < end; ++c) mine += size[c] < limit;
  int64_t j = 0;
  Scan(temp).ExclusiveSum(mine, j);
  for (int64_t c = begin; c < end; ++c) picks[c] = size[c] < limit ? draws[j++] : -1;
}

template <class T>
__global__ void replace_codes_kernel(int64_t k, int64_t d, const int64_t* picks, bool gather,
                                     const T* src, T limit, T* embed, T* embed_avg,
                                     T* cluster_size) {
  QUANTA_GRID_STRIDE(i, k * d) {
    const int64_t c = i / d, e = i % d, p = picks[c];
    if (p < 0) continue;
    const T s = src[(gather ? p : c) * d + e];
    embed[i] = T(1.0) * s;
    embed_avg[i] = limit * s;
    if (e == 0) cluster_size[c] = limit;
  }
}

}  // namespace

void dead_code_picks(DType dtype, const void* cluster_size, int64_t k, double threshold,
                     const int64_t* draws, int64_t* picks) {
  if (k <= 0) return;
  cuda::dispatch_float(dtype, "Codebook", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dead_code_picks_kernel<T><<<1, kPickThreads, 0, cuda::stream()>>>(
        static_cast<const T*>(cluster_size), k, static_cast<T>(threshold), draws, picks);
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void replace_codes(DType dtype, int64_t k, int64_t d, const int64_t* picks, bool gather,
                   const void* src, double threshold, void* embed, void* embed_avg,
                   void* cluster_size) {
  cuda::dispatch_float(dtype, "Codebook", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(k * d);
    if (g.blocks == 0) return;
    replace_codes_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        k, d, picks, gather, static_cast<const T*>(src), static_cast<T>(threshold),
        static_cast<T*>(embed), static_cast<T*>(embed_avg), static_cast<T*>(cluster_size));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void nearest_codes(DType dtype, const void* x, const void* codes, int64_t n, int64_t k, int64_t d,
                   bool cosine, int64_t* out) {
  cuda::dispatch_float(dtype, "nearest_codes", [&](auto tag) {
    using T = typename decltype(tag)::type;
    nearest<T>(static_cast<const T*>(x), static_cast<const T*>(codes), n, k, d, cosine, out);
  });
}

void squared_error(DType dtype, const void* x, const void* q, const uint8_t* valid, int64_t rows,
                   int64_t d, double* out) {
  const int64_t chunks = squared_error_chunks(rows);
  cuda::dispatch_float(dtype, "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    Scratch<Partial> partial(chunks > 0 ? chunks : 1);
    if (chunks > 0) {
      chunk_sums<T><<<static_cast<unsigned>(chunks), cuda::kThreadsPerBlock, 0, cuda::stream()>>>(
          static_cast<const T*>(x), static_cast<const T*>(q), valid, rows, d, partial.get());
      QUANTA_CUDA_CHECK_LAUNCH();
    }
    finish_sums<<<1, 1, 0, cuda::stream()>>>(partial.get(), chunks, d, out);
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

namespace {

template <class T>
__global__ void squared_error_mean_kernel(const double* sums, T* mean) {
  *mean = static_cast<T>(fn::squared_error_mean(sums));
}

template <class T>
__global__ void squared_error_coefficient_kernel(const T* g, double scale, const double* sums,
                                                 double* coef) {
  *coef = fn::squared_error_coefficient(double(*g), scale, sums);
}

}  // namespace

void squared_error_mean(DType dtype, const double* sums, void* mean) {
  cuda::dispatch_float(dtype, "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    squared_error_mean_kernel<T><<<1, 1, 0, cuda::stream()>>>(sums, static_cast<T*>(mean));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void squared_error_coefficient(DType g_dtype, const void* g, double scale, const double* sums,
                               double* coef) {
  cuda::dispatch_float(g_dtype, "commitment_loss backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    squared_error_coefficient_kernel<T>
        <<<1, 1, 0, cuda::stream()>>>(static_cast<const T*>(g), scale, sums, coef);
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void squared_error_grad(DType dtype, const void* x, const void* q, const uint8_t* valid,
                        int64_t rows, int64_t d, const double* scale, void* gx) {
  cuda::dispatch_float(dtype, "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(rows * d);
    if (g.blocks == 0) return;
    commit_grad_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(x), static_cast<const T*>(q), valid, rows, d, scale,
        static_cast<T*>(gx));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void route_grad(bool rotation, DType dtype, const void* x, const void* q, const void* g,
                const uint8_t* valid, const double* coef, int64_t rows, int64_t d, void* gx) {
  cuda::dispatch_float(dtype, "rotate_to", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *px = static_cast<const T*>(x), *pq = static_cast<const T*>(q),
            *pg = static_cast<const T*>(g);
    if (rotation) {
      const cuda::LaunchConfig c = warp_grid_for(d > 0 ? rows : 0);
      if (c.blocks == 0) return;
      rotation_kernel<T><<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
          px, pq, pg, valid, coef, rows, d, static_cast<T*>(gx));
    } else {
      const cuda::LaunchConfig c = grid_for(rows * d);
      if (c.blocks == 0) return;
      straight_kernel<T><<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
          px, pq, pg, valid, coef, rows, d, static_cast<T*>(gx));
    }
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

namespace {

template <class T>
__global__ void ema_lerp_kernel(int64_t n, T keep, T alpha, T* x, const T* a) {
  QUANTA_GRID_STRIDE(i, n) { x[i] = fn::ema_lerp(x[i], a[i], keep, alpha); }
}

template <class T>
__global__ void ema_embed_kernel(int64_t tables, int64_t k, int64_t d, T eps, T k_eps,
                                 const T* sizes, const T* totals, const T* avg, T* out) {
  QUANTA_GRID_STRIDE(i, tables * k * d) {
    const int64_t row = i / d;
    out[i] = quanta::fn::div_rn(avg[i], fn::smoothed_size(sizes[row], totals[row / k], eps, k_eps));
  }
}

}  // namespace

void ema_lerp(DType dtype, int64_t n, double keep, double alpha, void* x, const void* a) {
  cuda::dispatch_float(dtype, "Codebook EMA", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(n);
    if (g.blocks == 0) return;
    ema_lerp_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        n, T(keep), T(alpha), static_cast<T*>(x), static_cast<const T*>(a));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void ema_embed(DType dtype, int64_t tables, int64_t k, int64_t d, double eps,
               const void* cluster_size, const void* totals, const void* embed_avg, void* embed) {
  cuda::dispatch_float(dtype, "Codebook EMA", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const cuda::LaunchConfig g = grid_for(tables * k * d);
    if (g.blocks == 0) return;
    ema_embed_kernel<T><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        tables, k, d, T(eps), T(double(k) * eps), static_cast<const T*>(cluster_size),
        static_cast<const T*>(totals), static_cast<const T*>(embed_avg), static_cast<T*>(embed));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::quant::quant_cuda
