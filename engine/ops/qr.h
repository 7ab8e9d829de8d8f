#pragma once
// The QR decomposition of a matrix, for initialisations that need one
// (OLoRA's adapters from a weight, an orthogonal start's random rotation).
// Computed on the host by Eigen's Householder QR, in the matrix's own
// precision; not recorded by autograd.
#include <vector>

#include "engine/tensor.h"

namespace quanta {

/** a = q r for a [m, n] matrix: q [m, p] with orthonormal columns and r
 * [p, n] upper triangular, p = min(m, n) (torch.linalg.qr's "reduced"
 * mode). Householder reflections with LAPACK's geqrf's sign rule (each
 * reflection maps its column onto minus its leading entry's sign times its
 * norm), so the factors are the ones PyTorch's LAPACK gives, to rounding. */
struct ThinQR {
  Tensor q;
  Tensor r;
};

/** The thin QR of the 2-d f32 or f64 matrix a, in a's dtype and on its
 * device. Throws std::invalid_argument naming what is wrong for another rank
 * or dtype, an empty matrix, or a non-finite entry. */
ThinQR thin_qr(const Tensor& a);

/** thin_qr of several matrices, on the CPU's threads at once (one matrix
 * each): the same results as one at a time. Checks every matrix first. */
std::vector<ThinQR> thin_qr(const std::vector<Tensor>& matrices);

}  // namespace quanta
