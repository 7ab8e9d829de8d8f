// Fused optimizer steps on CUDA through the CPU's per-element updates
// (engine/kernels/optim_functors.h): SGD one grid-stride launch per
// parameter, Adam one launch per chunk of parameters, whose pointers and
// settings travel as the kernel's argument (no upload), one grid row each;
// clipping's scaling of every gradient (scale_n) likewise.
#include <cuda_runtime.h>

#include "engine/cuda/check.cuh"
#include "engine/cuda/chunked_launch.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/kernels/optim_functors.h"

namespace quanta::cuda {
namespace {

// The update is built by each thread from the settings, whose lr may live
// in device memory (a captured step's: SgdStep::live).
template <class T>
__global__ void sgd_kernel(SgdStep s, int64_t n, T* p, const T* g, T* buf) {
  const fn::SgdUpdate<T> f(fn::read_live(s));
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    f(p[i], g[i], buf ? buf + i : nullptr);
}

// Parameters per Adam launch: 16 of them are about 2 KB of kernel
// argument, under the 4 KB every CUDA version takes.
constexpr int kAdamChunk = 16;

template <class T>
struct AdamChunk {
  AdamStep s[kAdamChunk];
  int64_t n[kAdamChunk];
  T* p[kAdamChunk];
  const T* g[kAdamChunk];
  T* m[kAdamChunk];
  T* v[kAdamChunk];
  T* vmax[kAdamChunk];
};

// Grid row blockIdx.y updates the chunk's parameter y. Each thread builds
// the update from the settings, whose lr and bias corrections may live in
// device memory (a captured step's: AdamStep::live).
template <class T>
__global__ void adam_kernel(AdamChunk<T> c) {
  const int t = static_cast<int>(blockIdx.y);
  const int64_t n = c.n[t];
  const fn::AdamUpdate<T> f(fn::read_live(c.s[t]));
  T *p = c.p[t], *m = c.m[t], *v = c.v[t], *vmax = c.vmax[t];
  const T* g = c.g[t];
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    f(p[i], g[i], m[i], v[i], vmax ? vmax + i : nullptr);
}

// Tensors per scale_n launch (1 KB of kernel argument).
constexpr int kScaleChunk = 64;

template <class T>
struct ScaleChunk {
  T* x[kScaleChunk];
  int64_t n[kScaleChunk];
};

// Grid row blockIdx.y scales the chunk's tensor y by *factor, as mul_ does:
// in T, or for the 16-bit floats in f32 rounded once.
template <class T>
__global__ void scale_kernel(ScaleChunk<T> c, const T* factor) {
  const int t = static_cast<int>(blockIdx.y);
  const int64_t n = c.n[t];
  T* x = c.x[t];
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (is_half_v<T>) {
    const float f = convert<float>(*factor);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
      x[i] = convert<T>(convert<float>(x[i]) * f);
  } else {
    const T f = *factor;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
      x[i] = x[i] * f;
  }
}

template <class T>
void scale_chunks(const TensorSpanList& tensors, const void* factor) {
  launch_in_chunks<kScaleChunk, ScaleChunk<T>>(
      tensors,
      [](ScaleChunk<T>& c, int row, const TensorSpan& t) {
        c.x[row] = static_cast<T*>(t.data);
        c.n[row] = t.n;
      },
      [&](const ScaleChunk<T>& c, dim3 grid, int threads) {
        scale_kernel<T><<<grid, threads, 0, stream()>>>(c, static_cast<const T*>(factor));
      });
}

}  // namespace

void scale_n(DType dtype, const TensorSpanList& tensors, const void* factor) {
  if (visit_half(dtype,
                 [&](auto tag) { scale_chunks<typename decltype(tag)::type>(tensors, factor); }))
    return;
  dispatch_float(dtype, "clip_grad_norm_",
                 [&](auto tag) { scale_chunks<typename decltype(tag)::type>(tensors, factor); });
}

namespace {

// One thread: clipping's total and factor (fn::clip_total, fn::clip_factor),
// the factor converted as the copy kernels convert an f64.
template <class T>
__global__ void clip_factor_kernel(const double* norms, int64_t count, double p, double max_norm,
                                   double* total, T* factor) {
  const double t = fn::clip_total(norms, count, p);
  *total = t;
  *factor = convert<T>(fn::clip_factor(t, max_norm));
}

}  // namespace

void clip_factor(const double* norms, int64_t count, double p, double max_norm, DType factor_dtype,
                 double* total, void* factor) {
  const auto launch = [&](auto tag) {
    using T = typename decltype(tag)::type;
    clip_factor_kernel<T>
        <<<1, 1, 0, stream()>>>(norms, count, p, max_norm, total, static_cast<T*>(factor));
    QUANTA_CUDA_CHECK_LAUNCH();
  };
  if (visit_half(factor_dtype, launch)) return;
  dispatch_float(factor_dtype, "clip_grad_norm_", launch);
}

void sgd_step(const SgdStep& s, DType dtype, int64_t n, void* param, const void* grad,
              void* momentum_buffer) {
  if (n == 0) return;
  dispatch_float(dtype, "SGD step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const LaunchConfig cfg = launch_config(n, max_blocks());
    sgd_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        s, n, static_cast<T*>(param), static_cast<const T*>(grad),
        static_cast<T*>(momentum_buffer));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void adam_step(DType dtype, const AdamTensorList& tensors) {
  dispatch_float(dtype, "Adam step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_in_chunks<kAdamChunk, AdamChunk<T>>(
        tensors,
        [](AdamChunk<T>& c, int row, const AdamTensor& t) {
          c.s[row] = t.s;
          c.n[row] = t.n;
          c.p[row] = static_cast<T*>(t.param);
          c.g[row] = static_cast<const T*>(t.grad);
          c.m[row] = static_cast<T*>(t.exp_avg);
          c.v[row] = static_cast<T*>(t.exp_avg_sq);
          c.vmax[row] = static_cast<T*>(t.max_exp_avg_sq);
        },
        [](const AdamChunk<T>& c, dim3 grid, int threads) {
          adam_kernel<T><<<grid, threads, 0, stream()>>>(c);
        });
  });
}

}  // namespace quanta::cuda
