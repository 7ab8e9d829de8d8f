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
  draw::resolve_stream(f);  // each thread its own copy of the fill
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += step)
    draw::fill_block<W>(f, n, groups, b, out);
}

}  // namespace

void random_fill(const RandomFill& f, int64_t n, void* out) {
  const draw::Grouping gr = draw::grouping(f.draw, f.dtype);
  if (n == 0) return;
  const int64_t groups = draw::groups(gr, n), blocks = draw::blocks(gr, n);
  const LaunchConfig cfg = launch_config(blocks, max_blocks());
  draw::dispatch_fill<__nv_bfloat16, __half>(gr, f.dtype, [&]<int W, class T>() {
    random_fill_kernel<W, T><<<static_cast<unsigned>(cfg.blocks), cfg.threads, 0, stream()>>>(
        f, n, groups, blocks, static_cast<T*>(out));
  });
  QUANTA_CUDA_CHECK_LAUNCH();
}

}  // namespace quanta::cuda
