// The CUDA finishing pass of sq_dist: squared row norms of x and c, then one
// thread per output element for the clamped sum. The products came from
// cuBLAS.
#include <cuda_runtime.h>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"

namespace quanta::cuda {
namespace {

// Squared norms of `rows` rows of d values, L lanes per row (row_lanes): each
// lane sums every L-th value of its row in order, then a fixed butterfly of
// shuffles adds the lanes (the same order every run). The loop runs whole
// warps, so every lane reaches every shuffle.
template <class T, int L>
__global__ void row_sq_norms(const T* a, int64_t rows, int64_t d, T* out) {
  constexpr int kRowsPerWarp = 32 / L;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t base = warp * kRowsPerWarp; base < rows; base += warps * kRowsPerWarp) {
    const int64_t r = base + lane / L;
    T s = T(0);
    if (r < rows)
      for (int64_t e = lane % L; e < d; e += L) s += a[r * d + e] * a[r * d + e];
#pragma unroll
    for (int off = L / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off, L);
    if (r < rows && lane % L == 0) out[r] = s;
  }
}

// The norms of `rows` rows into out, with the lanes per row row_lanes picks.
template <class T>
void launch_row_norms(const T* a, int64_t rows, int64_t d, T* out) {
  const int lanes = row_lanes(d);
  const LaunchConfig cfg = launch_config(rows * lanes, max_blocks());
  const auto grid = static_cast<unsigned>(cfg.blocks);
  if (lanes == 32)
    row_sq_norms<T, 32><<<grid, cfg.threads, 0, stream()>>>(a, rows, d, out);
  else if (lanes == 8)
    row_sq_norms<T, 8><<<grid, cfg.threads, 0, stream()>>>(a, rows, d, out);
  else
    row_sq_norms<T, 1><<<grid, cfg.threads, 0, stream()>>>(a, rows, d, out);
  QUANTA_CUDA_CHECK_LAUNCH();
}

template <class T>
__global__ void finish(const T* xn, const T* cn, int64_t n, int64_t k, T* o) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n * k;
       e += step) {
    const T v = xn[e / k] + cn[e % k] - T(2) * o[e];
    o[e] = v > T(0) ? v : T(0);
  }
}

}  // namespace

void sq_dist_finish(DType dtype, const void* x, const void* c, int64_t n, int64_t k, int64_t d,
                    void* out) {
  if (n == 0 || k == 0) return;
  dispatch_float(dtype, "sq_dist", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* norms = nullptr;
    QUANTA_CUDA_CHECK(cudaMallocAsync(&norms, sizeof(T) * (n + k), stream()));
    launch_row_norms(static_cast<const T*>(x), n, d, norms);
    launch_row_norms(static_cast<const T*>(c), k, d, norms + n);
    const LaunchConfig all = launch_config(n * k, max_blocks());
    finish<T><<<static_cast<unsigned>(all.blocks), all.threads, 0, stream()>>>(
        norms, norms + n, n, k, static_cast<T*>(out));
    QUANTA_CUDA_CHECK_LAUNCH();
    QUANTA_CUDA_CHECK(cudaFreeAsync(norms, stream()));
  });
}

}  // namespace quanta::cuda
