// random_fill on CUDA: one thread per Philox block of four words, holding
// 4 / W whole groups, each mapped by the CPU's rule (engine/random/draw.h).
// Philox is ours (not cuRAND), so the device's streams are the CPU's bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/launch.h"
#include "engine/random/draw.h"

namespace quanta::cuda {
namespace {

template <int W, class T>
__global__ void random_fill_kernel(RandomFill f, int64_t n, int64_t groups, int64_t blocks,
                                   T* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += step)
    draw::fill_block<W>(f, n, groups, b, out);
}

template <class T>
void launch(const RandomFill& f, const draw::Grouping& gr, int64_t n, void* out) {
  const int64_t groups = draw::groups(gr, n), blocks = draw::blocks(gr, n);
  const LaunchConfig cfg = launch_config(blocks, max_blocks());
  T* p = static_cast<T*>(out);
  const auto grid = static_cast<unsigned>(cfg.blocks);
  if (gr.words == 1)
    random_fill_kernel<1, T><<<grid, cfg.threads>>>(f, n, groups, blocks, p);
  else if (gr.words == 2)
    random_fill_kernel<2, T><<<grid, cfg.threads>>>(f, n, groups, blocks, p);
  else
    random_fill_kernel<4, T><<<grid, cfg.threads>>>(f, n, groups, blocks, p);
  QUANTA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void random_fill(const RandomFill& f, int64_t n, void* out) {
  const draw::Grouping gr = draw::grouping(f.draw, f.dtype);
  if (n == 0) return;
  switch (f.dtype) {
    case DType::f32:
      return launch<float>(f, gr, n, out);
    case DType::f64:
      return launch<double>(f, gr, n, out);
    case DType::bf16:
      return launch<__nv_bfloat16>(f, gr, n, out);
    case DType::f16:
      return launch<__half>(f, gr, n, out);
    default:
      return launch<int64_t>(f, gr, n, out);
  }
}

}  // namespace quanta::cuda
