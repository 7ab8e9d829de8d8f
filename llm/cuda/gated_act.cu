// CUDA entries gated_act and gated_act_grad (llm/kernels/table.h): one thread
// per element, its math from llm/kernels/functors.h (the CPU's too).
#include <type_traits>

#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

// Both kernels load several elements before storing any
// (cuda::grid_stride_loads_first): the MLP's activations are the largest
// elementwise tensors of a language model, bf16 in mixed precision.
template <class T>
struct GateUp {
  T gate, up;
};

template <class T>
struct GateUpGrad {
  T gate, up, g;
};

template <GatedAct Act, class T, class A>
__global__ void gated_act_kernel(const T* gate, const T* up, int64_t n, T* out) {
  cuda::grid_stride_loads_first<cuda::loads_ahead(sizeof(GateUp<T>))>(
      n,
      [&](int64_t i) {
        return GateUp<T>{gate[i], up[i]};
      },
      [&](int64_t i, const GateUp<T>& v) {
        const A x = static_cast<A>(v.gate);
        const A e = fn::gated_transcendental<Act>(fn::gated_arg<Act>(x));
        out[i] = fn::gated_out<Act, T, A>(x, e, static_cast<A>(v.up));
      });
}

template <GatedAct Act, class T, class A>
__global__ void gated_act_grad_kernel(const T* gate, const T* up, const T* g, int64_t n, T* d_gate,
                                      T* d_up) {
  cuda::grid_stride_loads_first<cuda::loads_ahead(sizeof(GateUpGrad<T>))>(
      n,
      [&](int64_t i) {
        // up is read only for the gate's gradient, as before.
        return GateUpGrad<T>{gate[i], d_gate ? up[i] : T(0), g[i]};
      },
      [&](int64_t i, const GateUpGrad<T>& v) {
        const A x = static_cast<A>(v.gate), gi = static_cast<A>(v.g);
        const A e = fn::gated_transcendental<Act>(fn::gated_arg<Act>(x));
        if (d_up) d_up[i] = fn::gated_grad_up<Act, T, A>(x, e, gi);
        if (d_gate) d_gate[i] = fn::gated_grad_gate<Act, T, A>(x, e, static_cast<A>(v.up), gi);
      });
}

// f(std::integral_constant<GatedAct, act>{}): one kernel per activation.
template <class F>
void dispatch_act(GatedAct act, F&& f) {
  if (act == GatedAct::silu) return f(std::integral_constant<GatedAct, GatedAct::silu>{});
  return f(std::integral_constant<GatedAct, GatedAct::gelu_tanh>{});
}

}  // namespace

void gated_act(DType dtype, GatedAct act, const void* gate, const void* up, int64_t n, void* out) {
  dispatch_llm(dtype, "gated_activation", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig c = grid_for(n);
    if (c.blocks == 0) return;
    dispatch_act(act, [&](auto which) {
      constexpr GatedAct Act = decltype(which)::value;
      gated_act_kernel<Act, T, A>
          <<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
              static_cast<const T*>(gate), static_cast<const T*>(up), n, static_cast<T*>(out));
      QUANTA_CUDA_CHECK_LAUNCH();
    });
  });
}

void gated_act_grad(DType dtype, GatedAct act, const void* gate, const void* up, const void* g,
                    int64_t n, void* d_gate, void* d_up) {
  dispatch_llm(dtype, "gated_activation backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig c = grid_for(n);
    if (c.blocks == 0) return;
    dispatch_act(act, [&](auto which) {
      constexpr GatedAct Act = decltype(which)::value;
      gated_act_grad_kernel<Act, T, A>
          <<<static_cast<unsigned>(c.blocks), c.threads, 0, cuda::stream()>>>(
              static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(g), n,
              static_cast<T*>(d_gate), static_cast<T*>(d_up));
      QUANTA_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace quanta::llm::llm_cuda
