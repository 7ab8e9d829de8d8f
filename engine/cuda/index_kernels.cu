// The CUDA index family: slices by index, gathers and scatters along one
// dim, index_add. Like the CPU's, every line of a scatter is walked by one
// thread in index order, so duplicated indices overwrite, or accumulate, in
// the same order on every run: deterministic without float atomics. A
// gather writes each element once, so it takes one thread per element.
// index_add sorts the positions by index first (a stable radix sort, so
// equal indices keep their order) and gives each run of one index, column
// by column, a thread that adds the run in order: the bits of adding the
// positions one by one, with a thread per distinct index and column.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/index_kernels.h"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/cuda/scratch.h"

namespace quanta::cuda {
namespace {

template <class T>
__global__ void index_select_kernel(const T* in, int64_t outer, int64_t n, int64_t inner,
                                    const int64_t* ix, int64_t m, T* out) {
  const int64_t total = outer * m * inner;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    const int64_t k = e % inner, r = e / inner;
    const int64_t a = r / m, j = r % m;
    out[e] = in[(a * n + ix[j]) * inner + k];
  }
}

// flag is mapped host memory (cudaHostAllocMapped): the host reads it after
// the copy that ends its next read of the device.
__global__ void checked_indices_kernel(const int64_t* ix, int64_t n, int64_t size, int64_t* safe,
                                       DeviceErrorFlag* flag, int32_t check) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t v = ix[i];
    const bool ok = v >= 0 && v < size;
    if (!ok && atomicCAS(&flag->raised, 0, 1) == 0) {
      flag->check = check;
      flag->value = v;
    }
    safe[i] = ok ? v : 0;
  }
}

// The coordinates of a line, as offsets under up to three operands' strides.
struct LineWalk {
  int ndim = 0;
  int dim = 0;
  int64_t shape[kMaxIndexDims] = {};
  int64_t strides[3][kMaxIndexDims] = {};

  __device__ void base(int64_t line, int64_t (&b)[3]) const {
    b[0] = b[1] = b[2] = 0;
    for (int k = ndim - 1; k >= 0; --k) {
      if (k == dim) continue;
      const int64_t c = line % shape[k];
      line /= shape[k];
      for (int o = 0; o < 3; ++o) b[o] += c * strides[o][k];
    }
  }
};

template <class T, IndexMode Mode>
__global__ void index_lines_kernel(LineWalk w, int64_t lines, const int64_t* ix, T* o, const T* s,
                                   T value) {
  const int d = w.dim;
  const int64_t len = w.shape[d];
  // Operand order in the walk: idx, out, src.
  const int64_t is = w.strides[0][d], os = w.strides[1][d], ss = w.strides[2][d];
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t l = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; l < lines;
       l += step) {
    int64_t b[3];
    w.base(l, b);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = ix[b[0] + j * is];
      if constexpr (Mode == IndexMode::scatter_fill) {
        o[b[1] + i * os] = value;
      } else if constexpr (Mode == IndexMode::scatter_add) {
        T& dst = o[b[1] + i * os];
        dst = static_cast<T>(dst + s[b[2] + j * ss]);
      } else {
        o[b[1] + i * os] = s[b[2] + j * ss];
      }
    }
  }
}

// The gather of index_lines, one thread per element: out[.., j, ..] =
// src[.., idx[.., j, ..], ..] (the walk's operands: idx, out, src).
template <class T>
__global__ void gather_kernel(LineWalk w, int64_t total, const int64_t* ix, T* o, const T* s) {
  const int d = w.dim;
  const int64_t len = w.shape[d];
  const int64_t is = w.strides[0][d], os = w.strides[1][d], ss = w.strides[2][d];
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    const int64_t j = e % len;
    int64_t b[3];
    w.base(e / len, b);
    o[b[1] + j * os] = s[b[2] + ix[b[0] + j * is] * ss];
  }
}

template <class T>
__global__ void index_add_kernel(T* o, int64_t outer, int64_t n, int64_t inner, const int64_t* ix,
                                 int64_t m, const T* sp, T alpha) {
  const int64_t pairs = outer * inner;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += step) {
    const int64_t i = p / inner, k = p % inner;
    for (int64_t j = 0; j < m; ++j) {
      T& dst = o[(i * n + ix[j]) * inner + k];
      dst = static_cast<T>(dst + alpha * sp[(i * m + j) * inner + k]);
    }
  }
}

// keys[j] = idx[j], pos[j] = j: what index_add sorts.
__global__ void index_keys_kernel(const int64_t* ix, int64_t m, int32_t* keys, int32_t* pos) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += step) {
    keys[j] = static_cast<int32_t>(ix[j]);
    pos[j] = static_cast<int32_t>(j);
  }
}

// index_add over positions sorted by index (key[p] = idx[pos[p]]): the
// thread of (a, p, column k) where p starts a run of one index adds the
// run's rows of src in their original order into out[a, key[p], k].
template <class T>
__global__ void index_add_runs_kernel(T* o, int64_t outer, int64_t n, int64_t inner,
                                      const int32_t* key, const int32_t* pos, int64_t m,
                                      const T* sp, T alpha) {
  const int64_t total = outer * m * inner;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    const int64_t k = e % inner, r = e / inner;
    const int64_t p = r % m, a = r / m;
    const int32_t i = key[p];
    if (p > 0 && key[p - 1] == i) continue;  // not the head of its run
    T* dst = o + (a * n + i) * inner + k;
    T acc = *dst;
    for (int64_t q = p; q < m && key[q] == i; ++q)
      acc = static_cast<T>(acc + alpha * sp[(a * m + pos[q]) * inner + k]);
    *dst = acc;
  }
}

template <class T, IndexMode Mode>
void launch_lines(const LineWalk& w, int64_t lines, const Operand& idx, const Operand& out,
                  const Operand& src, double value) {
  if constexpr (Mode == IndexMode::gather) {
    const int64_t total = lines * w.shape[w.dim];
    const LaunchConfig cfg = launch_config(total, max_blocks());
    gather_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        w, total, static_cast<const int64_t*>(idx.data), static_cast<T*>(out.data),
        static_cast<const T*>(src.data));
  } else {
    const LaunchConfig cfg = launch_config(lines, max_blocks());
    index_lines_kernel<T, Mode><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        w, lines, static_cast<const int64_t*>(idx.data), static_cast<T*>(out.data),
        static_cast<const T*>(src.data), convert<T>(value));
  }
  QUANTA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void index_select(DType dtype, const void* src, int64_t outer, int64_t n, int64_t inner,
                  const int64_t* idx, int64_t m, void* out) {
  const int64_t total = outer * m * inner;
  if (total == 0) return;
  dispatch_all(dtype, "index_select", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const LaunchConfig cfg = launch_config(total, max_blocks());
    index_select_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        static_cast<const T*>(src), outer, n, inner, idx, m, static_cast<T*>(out));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

void checked_indices(const int64_t* idx, int64_t n, int64_t size, int64_t* safe,
                     DeviceErrorFlag* flag, int32_t check) {
  if (n == 0) return;
  const LaunchConfig cfg = launch_config(n, max_blocks());
  checked_indices_kernel<<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
      idx, n, size, safe, flag, check);
  QUANTA_CUDA_CHECK_LAUNCH();
}

void index_lines(IndexMode mode, const Shape& shape, int64_t dim, const Operand& idx,
                 const Operand& out, const Operand& src, double value) {
  const int64_t len = shape[dim];
  const int64_t lines = len ? numel_of(shape) / len : 0;
  if (lines == 0) return;
  const char* op = mode == IndexMode::gather        ? "gather"
                   : mode == IndexMode::scatter_add ? "scatter_add"
                                                    : "scatter";
  if (shape.size() > static_cast<size_t>(kMaxIndexDims))
    throw std::invalid_argument(std::string("[") + op + "] " + std::to_string(shape.size()) +
                                "-d operands; cuda takes at most " + std::to_string(kMaxIndexDims));
  // Walk operands: idx, out, src. A gather reads src at the index (so its
  // walk strides are src's), a scatter writes out there.
  LineWalk w;
  w.ndim = static_cast<int>(shape.size());
  w.dim = static_cast<int>(dim);
  const bool gather = mode == IndexMode::gather;
  const int64_t* walk[3] = {gather ? out.strides : idx.strides, out.strides,
                            mode == IndexMode::scatter_fill ? out.strides : src.strides};
  for (int k = 0; k < w.ndim; ++k) {
    w.shape[k] = shape[k];
    for (int o = 0; o < 3; ++o) w.strides[o][k] = walk[o][k];
  }
  // A gather's index has out's strides (its shape and layout are out's).
  if (gather) w.strides[0][dim] = out.strides[dim];
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (mode) {
      case IndexMode::gather:
        return launch_lines<T, IndexMode::gather>(w, lines, idx, out, src, value);
      case IndexMode::scatter_copy:
        return launch_lines<T, IndexMode::scatter_copy>(w, lines, idx, out, src, value);
      case IndexMode::scatter_fill:
        return launch_lines<T, IndexMode::scatter_fill>(w, lines, idx, out, src, value);
      case IndexMode::scatter_add:
        if constexpr (!std::is_same_v<T, bool> && !is_half_v<T>)
          return launch_lines<T, IndexMode::scatter_add>(w, lines, idx, out, src, value);
        return;
    }
  };
  if (mode == IndexMode::scatter_add)
    dispatch_numeric(out.dtype, op, run);
  else
    dispatch_all(out.dtype, op, run);
}

void index_add(DType dtype, void* out, int64_t outer, int64_t n, int64_t inner, const int64_t* idx,
               int64_t m, const void* src, double alpha) {
  dispatch_numeric(dtype, "index_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (outer * n * m * inner == 0) return;  // no row to add to, or nothing to add
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    if (n > kMax || m > kMax) {
      // Past 32-bit keys: one thread per (outer, column) pair walks every
      // position, in order.
      const LaunchConfig cfg = launch_config(outer * inner, max_blocks());
      index_add_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
          static_cast<T*>(out), outer, n, inner, idx, m, static_cast<const T*>(src),
          static_cast<T>(alpha));
      QUANTA_CUDA_CHECK_LAUNCH();
      return;
    }
    Scratch<int32_t> keys(2 * m), pos(2 * m);
    const LaunchConfig ck = launch_config(m, max_blocks());
    index_keys_kernel<<<static_cast<unsigned>(ck.blocks), ck.threads, 0, stream()>>>(
        idx, m, keys.get(), pos.get());
    QUANTA_CUDA_CHECK_LAUNCH();
    // Indices lie in [0, n): only their low bit_width(n - 1) bits need sorting.
    const int end_bit = std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(n - 1))));
    int32_t* sorted_keys = keys.get() + m;
    int32_t* sorted_pos = pos.get() + m;
    const int count = static_cast<int>(m);
    size_t temp_bytes = 0;
    QUANTA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.get(), sorted_keys,
                                                      pos.get(), sorted_pos, count, 0, end_bit,
                                                      stream()));
    Scratch<unsigned char> temp(std::max<int64_t>(1, static_cast<int64_t>(temp_bytes)));
    QUANTA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, keys.get(),
                                                      sorted_keys, pos.get(), sorted_pos, count, 0,
                                                      end_bit, stream()));
    const LaunchConfig cfg = launch_config(outer * m * inner, max_blocks());
    index_add_runs_kernel<T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        static_cast<T*>(out), outer, n, inner, sorted_keys, sorted_pos, m,
        static_cast<const T*>(src), static_cast<T>(alpha));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::cuda
