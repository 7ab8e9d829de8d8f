// CUDA entry rope (llm/kernels/table.h): one thread per rotated pair, the
// pair's math from llm/kernels/functors.h.
#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

template <class T, class A>
__global__ void rope_kernel(bool inverse, const T* x, const A* cos, const A* sin, int64_t rows,
                            int64_t table_rows, int64_t heads, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  QUANTA_GRID_STRIDE(i, rows * heads * half) {
    const int64_t d = i % half, line = i / half, r = line / heads % table_rows;
    const A s = sin[r * half + d];
    fn::rope_pair<T, A>(x[line * dim + d], x[line * dim + d + half], cos[r * half + d],
                        inverse ? -s : s, out + line * dim + d, out + line * dim + d + half);
  }
}

}  // namespace

void rope(DType dtype, bool inverse, const void* x, const void* cos, const void* sin, int64_t rows,
          int64_t table_rows, int64_t heads, int64_t dim, void* out) {
  dispatch_llm(dtype, "rope", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const cuda::LaunchConfig g = grid_for(rows * heads * (dim / 2));
    if (g.blocks == 0) return;
    rope_kernel<T, A><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        inverse, static_cast<const T*>(x), static_cast<const A*>(cos), static_cast<const A*>(sin),
        rows, table_rows, heads, dim, static_cast<T*>(out));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::llm::llm_cuda
