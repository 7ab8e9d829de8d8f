#pragma once
// Mixed precision: f32 matrix products (matmul, linear, conv) computed from
// bf16-rounded operands with f32 sums and an f32 result, where the device
// multiplies bf16 faster (the CPU's AVX512_BF16 or AMX through oneDNN;
// cuBLAS's bf16 tensor-core math on CUDA; cuDNN's TF32 for convolutions,
// cuDNN having no bf16 math for f32 data). Tensors, weights, gradients and
// optimizer state stay f32; only the products' inputs lose mantissa bits.
// This is what PyTorch calls a float32 matmul precision of "medium", rather
// than autocast: no op changes the dtype it returns, so nothing downstream
// (norms, losses, quantizer math) sees a 16-bit tensor.
//
// The switch is thread-local, like the grad mode. A backward runs each node
// in the precision its forward ran in (the autograd node records it), so a
// product made under MixedPrecision is differentiated in bf16 products and
// one made outside it in f32 products, wherever backward() is called.
// Quantizers switch it off for their own math (distances, codebook updates,
// rounding, entropies stay f32, as vector-quantize-pytorch disables
// autocast there). Products in f64, bf16 or f16 are unchanged. Where the
// device has no faster bf16 products (a CPU without bf16 dot-product
// instructions, or a build without oneDNN) products stay f32.
namespace quanta {

/** True while MixedPrecision(true) is the innermost guard on this thread. */
bool mixed_precision_enabled();

/** Turns bf16 products of f32 operands on (or, with enabled = false, off)
 * on this thread for its lifetime; guards nest. */
class MixedPrecision {
 public:
  explicit MixedPrecision(bool enabled = true);
  ~MixedPrecision();
  MixedPrecision(const MixedPrecision&) = delete;
  MixedPrecision& operator=(const MixedPrecision&) = delete;

 private:
  bool prev_;
};

}  // namespace quanta
