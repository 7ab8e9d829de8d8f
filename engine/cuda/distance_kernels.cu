// The CUDA finishing pass of sq_dist: squared row norms of x and c (one
// thread per row, summed in order like a plain loop), then one thread per
// output element for the clamped sum. The products came from cuBLAS.
#include <cuda_runtime.h>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"

namespace quanta::cuda {
namespace {

template <class T>
__global__ void row_sq_norms(const T* a, int64_t rows, int64_t d, T* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += step) {
    T s = T(0);
    for (int64_t e = 0; e < d; ++e) s += a[r * d + e] * a[r * d + e];
    out[r] = s;
  }
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
    const LaunchConfig rx = launch_config(n, max_blocks()), rc = launch_config(k, max_blocks());
    row_sq_norms<T><<<static_cast<unsigned>(rx.blocks), rx.threads, 0, stream()>>>(
        static_cast<const T*>(x), n, d, norms);
    QUANTA_CUDA_CHECK_LAUNCH();
    row_sq_norms<T><<<static_cast<unsigned>(rc.blocks), rc.threads, 0, stream()>>>(
        static_cast<const T*>(c), k, d, norms + n);
    QUANTA_CUDA_CHECK_LAUNCH();
    const LaunchConfig all = launch_config(n * k, max_blocks());
    finish<T><<<static_cast<unsigned>(all.blocks), all.threads, 0, stream()>>>(
        norms, norms + n, n, k, static_cast<T*>(out));
    QUANTA_CUDA_CHECK_LAUNCH();
    QUANTA_CUDA_CHECK(cudaFreeAsync(norms, stream()));
  });
}

}  // namespace quanta::cuda
