#pragma once
// The CPU quantizer table's entries, one family per file (nearest_kernels,
// commitment_kernels, rotation_kernels, codebook_kernels, lfq_kernels,
// nf4_kernels, nf4_linear_kernels); table.cpp puts them in the table, each a function named and
// typed as its entry in QuantKernelTable. Contracts: quant/kernels/table.h. Nothing here includes a
// layer header (quant/vq, quant/scalar, quant/nf4), engine/ops or engine/autograd.
#include <vector>

#include "quant/kernels/table.h"

namespace quanta::quant::quant_cpu {

/** Per-row 1/0 weights of a row mask (u8 [rows]), or empty when `valid` is
 * null (every row counts). */
template <class T>
std::vector<T> row_weights(const uint8_t* valid, int64_t rows) {
  if (!valid) return {};
  return std::vector<T>(valid, valid + rows);
}

QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_DECLARE_QUANT_KERNEL)

/** Rows from which nf4_linear decodes the weight in slabs, each multiplied by
 * one threaded product; fewer rows take per-thread tiles of kNF4TileElems. */
inline constexpr int64_t kNF4SlabMinBatch = 128;

/** Elements of one decoded weight slab (32 MiB of f32, 16 MiB of bf16): every
 * layer of a model up to a few billion parameters is one slab. */
inline constexpr int64_t kNF4SlabElems = int64_t{1} << 23;

/** Elements [begin, begin + count) of w as T (float or double): each the f32
 * product value(code) * scale rounded to `dtype` (f32, bf16 or f16). Shared
 * by the decode and the nf4_linear kernels. */
template <class T>
void nf4_decode_range(const NF4Runs& w, int64_t begin, int64_t count, DType dtype, T* out);

}  // namespace quanta::quant::quant_cpu
