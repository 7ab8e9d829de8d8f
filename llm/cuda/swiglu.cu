// CUDA entries swiglu and swiglu_grad (llm/kernels/table.h): one thread per
// element, its math from llm/kernels/functors.h (the CPU's too).
#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

template <class T, class A>
__global__ void swiglu_kernel(const T* gate, const T* up, int64_t n, T* out) {
  QUANTA_GRID_STRIDE(i, n) {
    const A x = static_cast<A>(gate[i]);
    out[i] = fn::swiglu_out<T, A>(x, exp(-x), static_cast<A>(up[i]));
  }
}

template <class T, class A>
__global__ void swiglu_grad_kernel(const T* gate, const T* up, const T* g, int64_t n, T* d_gate,
                                   T* d_up) {
  QUANTA_GRID_STRIDE(i, n) {
    const A x = static_cast<A>(gate[i]), e = exp(-x), gi = static_cast<A>(g[i]);
    if (d_up) d_up[i] = fn::swiglu_grad_up<T, A>(x, e, gi);
    if (d_gate) d_gate[i] = fn::swiglu_grad_gate<T, A>(x, e, static_cast<A>(up[i]), gi);
  }
}

}  // namespace

void swiglu(DType dtype, const void* gate, const void* up, int64_t n, void* out) {
  dispatch_llm(dtype, "swiglu", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig c = grid_for(n);
    if (c.blocks == 0) return;
    swiglu_kernel<T, A><<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), n, static_cast<T*>(out));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_grad(DType dtype, const void* gate, const void* up, const void* g, int64_t n,
                 void* d_gate, void* d_up) {
  dispatch_llm(dtype, "swiglu backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig c = grid_for(n);
    if (c.blocks == 0) return;
    swiglu_grad_kernel<T, A><<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(g), n,
        static_cast<T*>(d_gate), static_cast<T*>(d_up));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::llm::llm_cuda
