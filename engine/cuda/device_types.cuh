#pragma once
// What every CUDA kernel file shares: the device element type of a dtype
// (CUDA's own 16-bit floats, the same bits as the CPU's Eigen types), value
// conversion with the CPU's rules, dtype dispatch that names the op, and the
// grid size cap. Included by .cu files only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "engine/cuda/check.cuh"
#include "engine/cuda/launch.h"
#include "engine/cuda/stream.h"
#include "engine/dtype.h"

namespace quanta::cuda {

template <class T>
struct Tag {
  using type = T;
};

[[noreturn]] inline void bad_dtype(const char* op, DType t, const char* what) {
  throw std::invalid_argument(std::string("[") + op + "] dtype " + dtype_name(t) +
                              " is not supported on cuda (" + what + ")");
}

// The device's element type of a dtype (CUDA's own 16-bit floats: the same
// bits as the CPU's Eigen types).
template <class F>
inline void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32:
      return f(Tag<float>{});
    case DType::f64:
      return f(Tag<double>{});
    default:
      bad_dtype(op, t, "expected f32 or f64");
  }
}
template <class F>
inline void dispatch_numeric(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::i32:
      return f(Tag<int32_t>{});
    case DType::i64:
      return f(Tag<int64_t>{});
    case DType::u8:
      return f(Tag<uint8_t>{});
    case DType::f32:
    case DType::f64:
      return dispatch_float(t, op, f);
    default:
      bad_dtype(op, t, "expected f32, f64, i32, i64 or u8");
  }
}
template <class F>
inline void dispatch_all(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::bf16:
      return f(Tag<__nv_bfloat16>{});
    case DType::f16:
      return f(Tag<__half>{});
    case DType::boolean:
      return f(Tag<bool>{});
    case DType::f32:
    case DType::f64:
    case DType::i32:
    case DType::i64:
    case DType::u8:
      return dispatch_numeric(t, op, f);
    default:
      bad_dtype(op, t, "a byte-only format: dequantize it first");
  }
}

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

/** Calls f(Tag<H>) and returns true when t is a 16-bit float (CUDA's bf16 or
 * f16); returns false, calling nothing, for every other dtype. */
template <class F>
inline bool visit_half(DType t, F&& f) {
  if (t == DType::bf16) {
    f(Tag<__nv_bfloat16>{});
    return true;
  }
  if (t == DType::f16) {
    f(Tag<__half>{});
    return true;
  }
  return false;
}

// Value conversion with the CPU's rules (engine/cpu/convert.h): 16-bit
// floats go through float, rounding to nearest even; bool is "non-zero".
template <class D, class S>
__host__ __device__ D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    return convert<D>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<S, __half>) {
    return convert<D>(__half2float(v));
  } else if constexpr (std::is_same_v<D, bool>) {
    return v != S(0);
  } else if constexpr (std::is_same_v<D, __nv_bfloat16>) {
    return __float2bfloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<D, __half>) {
    return __float2half(static_cast<float>(v));
  } else if constexpr (std::is_integral_v<D> && std::is_floating_point_v<S>) {
    // The CPU's rule (engine/cpu/convert.h): truncate through i64, then wrap.
    return static_cast<D>(static_cast<int64_t>(v));
  } else {
    return static_cast<D>(v);
  }
}

// A few waves of blocks per multiprocessor; the grid-stride loop does the rest.
// The count is read once per device: this runs before every launch.
inline int64_t max_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms_of[kMaxDevices] = {};
  int dev = 0;
  QUANTA_CUDA_CHECK(cudaGetDevice(&dev));
  int sms = dev < kMaxDevices ? sms_of[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    QUANTA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    if (dev < kMaxDevices) sms_of[dev].store(sms, std::memory_order_relaxed);
  }
  return static_cast<int64_t>(sms) * 8;
}

// Calls store(i, load(i)) for i = first, first + step, ... below n, with
// the loads of U elements made before any of their stores, and the stores
// in order. A thread that loads, computes and stores one element at a time
// has one load per operand in flight, since the next load cannot pass a
// store that might alias it: on the H200 that held exp over 268 MB to 2.1x
// the time of a copy (3.7x in bf16, whose loads are half as wide). An
// element's load and store stay in one thread, so an op in place is as safe
// as one at a time.
template <int U, class Load, class Store>
__device__ inline void strided_loads_first(int64_t first, int64_t step, int64_t n, Load&& load,
                                           Store&& store) {
  for (; first < n; first += U * step) {
    decltype(load(first)) v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (first + u * step < n) v[u] = load(first + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (first + u * step < n) store(first + u * step, v[u]);
  }
}

// strided_loads_first over this thread's share of a grid-stride walk over
// [0, n) (a grid's step apart, so a warp's loads stay contiguous).
template <int U, class Load, class Store>
__device__ inline void grid_stride_loads_first(int64_t n, Load&& load, Store&& store) {
  strided_loads_first<U>(static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                         static_cast<int64_t>(gridDim.x) * blockDim.x, n, load, store);
}

// Elements grid_stride_loads_first loads ahead when each brings `bytes`
// bytes in: about 16 bytes a thread (2048 threads of an SM then keep some 32
// KiB in flight, what an H200's bandwidth times its latency asks of each),
// at least 2 elements and at most 8.
constexpr int loads_ahead(std::size_t bytes) {
  const std::size_t u = bytes == 0 ? 8 : 16 / bytes;
  return u < 2 ? 2 : u > 8 ? 8 : static_cast<int>(u);
}

// Launches kernel(n, args...), a grid-stride loop over n elements, on the
// current device's default stream; nothing for n <= 0.
template <class Kernel, class... Args>
void launch_elements(int64_t n, Kernel kernel, Args... args) {
  if (n <= 0) return;
  const LaunchConfig cfg = launch_config(n, max_blocks());
  kernel<<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(n, args...);
  QUANTA_CUDA_CHECK_LAUNCH();
}

}  // namespace quanta::cuda
