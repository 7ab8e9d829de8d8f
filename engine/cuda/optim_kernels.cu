// Fused optimizer steps on CUDA: one grid-stride launch per parameter
// through the CPU's per-element updates (engine/kernels/optim_functors.h).
#include <cuda_runtime.h>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/kernels/optim_functors.h"

namespace quanta::cuda {
namespace {

template <class T>
__global__ void sgd_kernel(fn::SgdUpdate<T> f, int64_t n, T* p, const T* g, T* buf) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    f(p[i], g[i], buf ? buf + i : nullptr);
}

template <class T>
__global__ void adam_kernel(fn::AdamUpdate<T> f, int64_t n, T* p, const T* g, T* m, T* v, T* vmax) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    f(p[i], g[i], m[i], v[i], vmax ? vmax + i : nullptr);
}

}  // namespace

void sgd_step(const SgdStep& s, DType dtype, int64_t n, void* param, const void* grad,
              void* momentum_buffer) {
  if (n == 0) return;
  dispatch_float(dtype, "SGD step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const LaunchConfig cfg = launch_config(n, max_blocks());
    sgd_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads>>>(
        fn::SgdUpdate<T>(s), n, static_cast<T*>(param), static_cast<const T*>(grad),
        static_cast<T*>(momentum_buffer));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void adam_step(const AdamStep& s, DType dtype, int64_t n, void* param, const void* grad,
               void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq) {
  if (n == 0) return;
  dispatch_float(dtype, "Adam step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const LaunchConfig cfg = launch_config(n, max_blocks());
    adam_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads>>>(
        fn::AdamUpdate<T>(s), n, static_cast<T*>(param), static_cast<const T*>(grad),
        static_cast<T*>(exp_avg), static_cast<T*>(exp_avg_sq), static_cast<T*>(max_exp_avg_sq));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::cuda
