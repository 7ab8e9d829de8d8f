#pragma once
// The CUDA language-model table's entries (rms_norm.cu, rope.cu,
// gated_act.cu, attention.cu); table.cu puts them in the table the CUDA module exports. Contracts:
// llm/kernels/table.h. Pointers are on the current device; everything is queued on its default
// stream.
#include "llm/kernels/table.h"

namespace quanta::llm::llm_cuda {

/** The largest head_dim the attention kernels take (a warp holds a query's
 * head in registers, kMaxDimPerLane values per lane). */
inline constexpr int64_t kMaxDimPerLane = 8;

QUANTA_LLM_KERNEL_ENTRIES(QUANTA_DECLARE_LLM_KERNEL)

}  // namespace quanta::llm::llm_cuda
