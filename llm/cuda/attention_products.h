#pragma once
// CUDA attention as whole-matrix products over chunks of heads
// (llm/kernels/attention_plan.h), behind the attention entries of
// attention.cu, which choose it (QUANTA_CUDA_ATTENTION, and sizes the plan
// takes) over the warp-per-row reference kernels.
#include "llm/kernels/table.h"

namespace quanta::llm::llm_cuda {

/** The forward entry's work (a.out, a.lse) through the plan. */
void attention_products(const AttentionArgs& a);

/** The backward entry's work through the plan, delta (each query's dO.O,
 * [batch, heads, q_len], accumulation dtype) already computed. */
void attention_products_grad(const AttentionArgs& a, const void* grad_out, const void* delta,
                             void* gq, void* gk, void* gv);

}  // namespace quanta::llm::llm_cuda
