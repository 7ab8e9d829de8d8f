#pragma once
// One block's combination of a value from every thread (CUB's block
// reduction), shared by the row reductions and the normalisation kernels.
#include <cub/block/block_reduce.cuh>

#include "engine/cuda/launch.h"

namespace quanta::cuda {

/** The combination of every thread's `v` under `comb`, returned to every
 * thread; all kThreadsPerBlock threads of the block call it together (it
 * synchronises). */
template <class Acc, class Combine>
__device__ Acc block_combine(Acc v, Combine comb) {
  using Reduce = cub::BlockReduce<Acc, kThreadsPerBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ Acc total;
  const Acc t = Reduce(tmp).Reduce(v, comb);
  if (threadIdx.x == 0) total = t;
  __syncthreads();
  const Acc out = total;
  __syncthreads();  // tmp and total are reused by the next call
  return out;
}

}  // namespace quanta::cuda
