#pragma once
// Internal to quant/nf4: the run views of NF4 tensors and states (the views
// themselves, NF4Runs and NF4RunsOut, live with the kernels in
// quant/kernels/nf4_layout.h; the kernels in quant/kernels/table.h), and the
// format's argument checks.
#include <cstdint>

#include "engine/dtype.h"
#include "engine/tensor.h"
#include "quant/kernels/nf4_layout.h"

namespace quanta::quant::detail {

using quant::NF4Runs;
using quant::NF4RunsOut;

/** The runs of a (checked) nf4 dtype tensor, on its device. */
NF4Runs unit_runs(const Tensor& nf4);

/** The runs of bitsandbytes' packed codes ((n + 1) / 2 bytes) with one f32
 * scale per `block` elements (32, or a multiple of 64). */
inline NF4Runs packed_runs(const uint8_t* packed, const float* scales, int64_t n, int64_t block) {
  return nf4_packed_runs(packed, scales, n, block);
}

/** f32 contiguous CPU copy of a floating tensor; throws naming `op` otherwise
 * (host-side paths: interop, layout conversion). */
Tensor as_f32_cpu(const Tensor& x, const char* op);

/** f32 contiguous copy of a floating tensor on its own device; throws naming
 * `op` otherwise. */
Tensor as_f32(const Tensor& x, const char* op);

/** Throws std::invalid_argument("[op] ...") unless dtype is f32, bf16 or f16. */
void check_dequant_dtype(DType dtype, const char* op);

}  // namespace quanta::quant::detail
