#pragma once
// Shape and strides to element offsets, for kernels that walk N operands
// over one shape (broadcast inputs have stride 0). The walk is QUANTA_HD so
// a CUDA thread computes exactly what the CPU tests check. The host builder
// merges dims that are contiguous in every operand and drops size-1 dims, so
// most tensors collapse to one or two dims and the per-element divisions stay
// few; below 2^31 elements each is a multiply and a shift (IntDivider).
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "engine/kernels/functors.h"  // QUANTA_HD
#include "engine/kernels/int_divider.h"
#include "engine/shape.h"

namespace quanta {

/** Dims left after merging; a tensor that needs more fails with a clear
 * error (PyTorch's CUDA limit is 25; ours is smaller because this struct is
 * passed by value to every launch). */
inline constexpr int kMaxKernelDims = 8;

template <int N>
struct StridedIndex {
  int ndim = 0;
  bool dense = true;   // every operand contiguous: offset == linear index
  bool narrow = true;  // fewer than 2^31 elements: 32-bit positions, divided by
                       // multiply and shift (IntDivider) instead of 64-bit division
  int64_t shape[kMaxKernelDims] = {};
  IntDivider divider[kMaxKernelDims] = {};  // by shape[d], when narrow
  int64_t strides[N][kMaxKernelDims] = {};

  /** The N operands' element offsets of the element at row-major position
   * `linear` of the shape. */
  QUANTA_HD void offsets(int64_t linear, int64_t (&off)[N]) const {
    for (int k = 0; k < N; ++k) off[k] = dense ? linear : 0;
    if (dense) return;
    // The loops over dims stay rolled on the device: unrolled in each of the
    // elementwise walk's bodies they double its file's build time.
    if (narrow) {
      auto pos = static_cast<uint32_t>(linear);
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
      for (int d = ndim - 1; d >= 0; --d) {
        const uint32_t q = divider[d].div(pos);
        const auto idx = static_cast<int64_t>(pos - q * divider[d].divisor);
        pos = q;
        for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
      }
      return;
    }
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t size = shape[d];
      const int64_t idx = linear % size;
      linear /= size;
      for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
    }
  }

  /** offsets() for an index of D dims (1: also 0 dims; 2), D fixed where the
   * kernel is compiled: no loop over dims and at most one division, so a
   * kernel can compute several elements' offsets at once cheaply (a scalar
   * or row broadcast, a transpose). */
  template <int D>
  QUANTA_HD void offsets_of_dims(int64_t linear, int64_t (&off)[N]) const {
    static_assert(D == 1 || D == 2, "one or two dims");
    if constexpr (D == 1) {
      for (int k = 0; k < N; ++k) off[k] = linear * strides[k][0];  // 0 dims: strides 0
    } else {
      int64_t row, col;
      if (narrow) {
        const auto pos = static_cast<uint32_t>(linear);
        const uint32_t q = divider[1].div(pos);
        row = q;
        col = static_cast<int64_t>(pos - q * divider[1].divisor);
      } else {
        row = linear / shape[1];
        col = linear % shape[1];
      }
      for (int k = 0; k < N; ++k) off[k] = row * strides[k][0] + col * strides[k][1];
    }
  }
};

/** Builds the index of `shape` with operand k's strides in strides[k]; throws
 * naming `op` when more than kMaxKernelDims dims remain after merging. */
template <int N>
StridedIndex<N> make_strided_index(const Shape& shape, const std::array<const int64_t*, N>& strides,
                                   const char* op) {
  StridedIndex<N> ix;
  // Walk from the innermost dim outwards, merging a dim into the one inside
  // it when every operand steps over the inner one exactly.
  int64_t merged_shape[64];
  int64_t merged[N][64];
  int nd = 0;
  for (size_t i = shape.size(); i-- > 0;) {
    const int64_t size = shape[i];
    if (size == 1) continue;
    if (size == 0) {  // nothing to walk
      ix.ndim = 0;
      return ix;
    }
    bool can_merge = nd > 0;
    for (int k = 0; k < N && can_merge; ++k)
      can_merge = strides[k][i] == merged[k][nd - 1] * merged_shape[nd - 1];
    if (can_merge) {
      // The merged dim keeps the inner stride: stepping past the inner
      // dim's end is exactly one step of the outer one.
      merged_shape[nd - 1] *= size;
      continue;
    }
    if (nd == 64 || nd == kMaxKernelDims)
      throw std::invalid_argument(std::string("[") + op + "] " + std::to_string(shape.size()) +
                                  "-d operands whose strides leave more than " +
                                  std::to_string(kMaxKernelDims) +
                                  " dims after merging; make them contiguous first");
    merged_shape[nd] = size;
    for (int k = 0; k < N; ++k) merged[k][nd] = strides[k][i];
    ++nd;
  }
  // merged[*][0] is the innermost dim; the index stores outermost first.
  ix.ndim = nd;
  for (int d = 0; d < nd; ++d) {
    ix.shape[d] = merged_shape[nd - 1 - d];
    for (int k = 0; k < N; ++k) ix.strides[k][d] = merged[k][nd - 1 - d];
  }
  int64_t numel = 1;
  for (int d = 0; d < nd; ++d) numel *= ix.shape[d];
  ix.narrow = numel < (int64_t(1) << 31);
  if (ix.narrow)
    for (int d = 0; d < nd; ++d) ix.divider[d] = IntDivider(static_cast<uint32_t>(ix.shape[d]));
  ix.dense = nd <= 1;
  for (int k = 0; k < N && ix.dense; ++k) ix.dense = nd == 0 || ix.strides[k][0] == 1;
  return ix;
}

}  // namespace quanta
