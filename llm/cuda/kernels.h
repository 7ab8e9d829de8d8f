#pragma once
// The CUDA language-model table's entries (rms_norm.cu, rope.cu,
// attention.cu); module_table.cu puts them in the table the CUDA module
// exports. Contracts: llm/kernels/table.h. Pointers are on the current
// device; everything is queued on its default stream.
#include "llm/kernels/table.h"

namespace quanta::llm::llm_cuda {

/** The largest head_dim the attention kernels take (a warp holds a query's
 * head in registers, kMaxDimPerLane values per lane). */
inline constexpr int64_t kMaxDimPerLane = 8;

void rms_norm(DType dtype, const void* x, const void* weight, int64_t rows, int64_t n, double eps,
              void* y, void* inv_rms);
void rms_norm_grad(DType dtype, const void* x, const void* weight, const void* inv_rms,
                   const void* gy, int64_t rows, int64_t n, void* gx, void* gw);
void rope(DType dtype, bool inverse, const void* x, const void* cos, const void* sin, int64_t rows,
          int64_t heads, int64_t dim, void* out);
void attention(const AttentionArgs& a);
void attention_grad(const AttentionArgs& a, const void* grad_out, void* delta, void* gq, void* gk,
                    void* gv);

}  // namespace quanta::llm::llm_cuda
