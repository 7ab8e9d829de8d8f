#pragma once
// What the CUDA language-model kernels share (included by llm/cuda/*.cu
// only): the quantizers' launch helpers and warp sums, and a dtype dispatch
// that gives each entry its device data type and accumulation type.
#include <stdexcept>
#include <string>

#include "engine/cuda/device_types.cuh"
#include "quant/cuda/device.cuh"

namespace quanta::llm::llm_cuda {

using quant::quant_cuda::grid_for;
using quant::quant_cuda::kWarp;
using quant::quant_cuda::warp_grid_for;
using quant::quant_cuda::warp_sum;

template <class T, class A>
struct Types {
  using data = T;
  using acc = A;
};

template <class F>
void dispatch_llm(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32:
      return f(Types<float, float>{});
    case DType::f64:
      return f(Types<double, double>{});
    case DType::bf16:
      return f(Types<__nv_bfloat16, float>{});
    case DType::f16:
      return f(Types<__half, float>{});
    default:
      cuda::bad_dtype(op, t, "expected f32, f64, bf16 or f16");
  }
}

}  // namespace quanta::llm::llm_cuda
