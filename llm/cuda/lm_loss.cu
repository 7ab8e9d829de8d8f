// CUDA entry lm_loss_rows (llm/kernels/table.h): a warp per row of logits,
// its max and sum of exponentials by warp reductions in a fixed order, the
// per-element math from llm/kernels/functors.h (the CPU's, so the CPU tests
// cover it).
#include <cmath>

#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

// The max over a warp's lanes, the same on every lane.
template <class A>
__device__ A warp_max(A v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class A>
__global__ void lm_loss_rows_kernel(A* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                    int64_t ignore_index, bool grad, A* loss) {
  const int lane = threadIdx.x % kWarp;
  QUANTA_WARP_STRIDE(r, rows) {
    A* x = logits + r * vocab;
    const int64_t t = targets[r];
    if (t == ignore_index || vocab == 0) {  // as the CPU: no logit to read
      if (lane == 0) loss[r] = A(0);
      if (grad)
        for (int64_t j = lane; j < vocab; j += kWarp) x[j] = A(0);
      continue;
    }
    A m = -INFINITY;
    for (int64_t j = lane; j < vocab; j += kWarp) m = fmax(m, x[j]);
    m = warp_max(m);
    // Every lane reads the target's logit before any lane overwrites it.
    const A target_logit = x[t];
    __syncwarp();
    A s = 0;
    for (int64_t j = lane; j < vocab; j += kWarp) {
      const A e = exp(x[j] - m);
      if (grad) x[j] = e;
      s += e;
    }
    s = warp_sum(s);
    if (lane == 0) loss[r] = fn::lm_row_loss<A>(m, s, target_logit);
    if (!grad) continue;
    const A inv = A(1) / s;
    for (int64_t j = lane; j < vocab; j += kWarp) x[j] = fn::lm_logit_grad<A>(x[j], inv, j == t);
  }
}

}  // namespace

void lm_loss_rows(DType dtype, void* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                  int64_t ignore_index, bool grad, void* loss) {
  cuda::dispatch_float(dtype, "chunked_causal_lm_loss", [&](auto tag) {
    using A = typename decltype(tag)::type;
    const cuda::LaunchConfig g = warp_grid_for(rows);
    if (g.blocks == 0) return;
    lm_loss_rows_kernel<A><<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
        static_cast<A*>(logits), targets, rows, vocab, ignore_index, grad, static_cast<A*>(loss));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::llm::llm_cuda
