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

#include "engine/kernels/reduce_functors.h"  // fold_share
#include "llm/cuda/device.cuh"
#include "llm/cuda/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cuda {
namespace {

constexpr int kLossThreads = 256;
constexpr int kLoadsAhead = 8;

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
    // Each pass reads kLoadsAhead logits before using any (a block of 256
    // threads with one load each in flight moves too little a row), in the
    // plain loop's order.
    A m = quanta::fn::fold_share(A(-INFINITY), x, tid, kLossThreads, vocab,
                                 [](A a, A v, int64_t) { return fmax(a, v); });
    m = Reduce(tmp).Reduce(m, MaxOf{});  // thread 0's
    if (tid == 0) row_value = m;
    __syncthreads();
    m = row_value;
    const A target_logit = x[t];
    // Every thread has the max and the target's logit before any logit is
    // overwritten, and tmp is free again.
    __syncthreads();
    A s = 0;
    cuda::strided_loads_first<kLoadsAhead>(
        tid, kLossThreads, vocab, [&](int64_t j) { return x[j]; },
        [&](int64_t j, A v) {
          const A e = exp(v - m);
          if (grad) x[j] = e;
          s += e;
        });
    s = Reduce(tmp).Sum(s);  // thread 0's
    if (tid == 0) {
      loss[r] = fn::lm_row_loss<A>(m, s, target_logit);
      row_value = s;
    }
    __syncthreads();
    if (grad) {
      const A inv = A(1) / row_value;
      cuda::strided_loads_first<kLoadsAhead>(
          tid, kLossThreads, vocab, [&](int64_t j) { return x[j]; },
          [&](int64_t j, A v) { x[j] = fn::lm_logit_grad<A>(v, inv, j == t); });
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
