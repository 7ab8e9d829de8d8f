#pragma once
// One bf16 rounding of an f32 input, shared by the products that read it. A
// layer whose products multiply in bf16 (NF4 weights with bf16 compute)
// rounds its f32 input first, a pass over it; the projections of one input
// (a decoder's q, k and v, or gate and up) each made that pass over the
// same tensor. Within a SharedBf16Input guard of x, the first such product
// rounds x into a buffer the guard holds and the others read it: the same
// bits, one pass. The rounding is to nearest even, as every bf16 rounding of
// the engine's.
//
// The guard is thread-local, like the grad mode, and holds x (so its
// storage cannot be freed and reused while the guard lives); the caller
// promises not to write x while it lives. Products of any other tensor are
// unaffected. Guards nest.
#include "engine/tensor.h"

namespace quanta {

/** Shares one bf16 rounding of `x` among the products on this thread that
 * round it, for the guard's lifetime. An undefined or non-f32 x makes a guard
 * that does nothing. */
class SharedBf16Input {
 public:
  explicit SharedBf16Input(const Tensor& x);
  ~SharedBf16Input();
  SharedBf16Input(const SharedBf16Input&) = delete;
  SharedBf16Input& operator=(const SharedBf16Input&) = delete;
};

namespace detail {

/** x's shared rounding under the innermost live guard of this tensor: the
 * bf16 buffer of x's shape on x's device, and whether a product has written
 * it yet. */
struct SharedBf16Slot {
  Tensor rounded;
  bool written = false;
};

/** The slot of the innermost guard on this thread whose tensor is x (the same
 * data, dtype, device, shape and strides), its buffer made on first call; null
 * where no guard holds x. The caller writes the buffer when `written` is
 * false and sets it. */
SharedBf16Slot* shared_bf16_input(const Tensor& x);

}  // namespace detail

}  // namespace quanta
