// CUDA entry lm_loss_rows (llm/kernels/table.h): a block per row of logits,
// its max and sum of exponentials by CUB's block reduction (a fixed order
// for the fixed block size, so the same bits on every run), the per-element
// math from llm/kernels/functors.h (the CPU's, so the CPU tests cover it).
//
// A block, not a warp, per row: a chunk holds a few hundred rows (about 128
// MiB of logits, llm/model/lm_loss.h), which as warps left some 5 an SM to
// walk rows of tens of thousands of logits, three times: too few loads in
// flight to keep the memory busy.
#include <cmath>
#include <cub/block/block_reduce.cuh>

#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

constexpr int kLossThreads = 256;

// fmax ignores a NaN, as the warp version did.
struct MaxOf {
  template <class A>
  __device__ A operator()(A a, A b) const {
    return fmax(a, b);
  }
};

template <class A>
__global__ void __launch_bounds__(kLossThreads)
    lm_loss_rows_kernel(A* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                        int64_t ignore_index, bool grad, A* loss) {
  using Reduce = cub::BlockReduce<A, kLossThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ A row_value;  // the block's max, then its sum
  const int tid = static_cast<int>(threadIdx.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    A* x = logits + r * vocab;
    const int64_t t = targets[r];           // the same for the whole block
    if (t == ignore_index || vocab == 0) {  // as the CPU: no logit to read
      if (tid == 0) loss[r] = A(0);
      if (grad)
        for (int64_t j = tid; j < vocab; j += kLossThreads) x[j] = A(0);
      continue;
    }
    A m = -INFINITY;
    for (int64_t j = tid; j < vocab; j += kLossThreads) m = fmax(m, x[j]);
    m = Reduce(tmp).Reduce(m, MaxOf{});  // thread 0's
    if (tid == 0) row_value = m;
    __syncthreads();
    m = row_value;
    const A target_logit = x[t];
    // Every thread has the max and the target's logit before any logit is
    // overwritten, and tmp is free again.
    __syncthreads();
    A s = 0;
    for (int64_t j = tid; j < vocab; j += kLossThreads) {
      const A e = exp(x[j] - m);
      if (grad) x[j] = e;
      s += e;
    }
    s = Reduce(tmp).Sum(s);  // thread 0's
    if (tid == 0) {
      loss[r] = fn::lm_row_loss<A>(m, s, target_logit);
      row_value = s;
    }
    __syncthreads();
    if (grad) {
      const A inv = A(1) / row_value;
      for (int64_t j = tid; j < vocab; j += kLossThreads)
        x[j] = fn::lm_logit_grad<A>(x[j], inv, j == t);
    }
    __syncthreads();  // row_value and tmp are read before the next row writes them
  }
}

}  // namespace

void lm_loss_rows(DType dtype, void* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                  int64_t ignore_index, bool grad, void* loss) {
  cuda::dispatch_float(dtype, "chunked_causal_lm_loss", [&](auto tag) {
    using A = typename decltype(tag)::type;
    if (rows <= 0) return;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, cuda::max_blocks()));
    lm_loss_rows_kernel<A><<<blocks, kLossThreads, 0, cuda::stream()>>>(
        static_cast<A*>(logits), targets, rows, vocab, ignore_index, grad, static_cast<A*>(loss));
    QUANTA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quanta::llm::llm_cuda
