#pragma once
// The singular value decomposition of a matrix, for initialisations that
// need one (LoftQ's adapters from a quantization error, PiSSA's from a
// weight). Computed on the host by Eigen's divide-and-conquer SVD (BDCSVD),
// or approximated from a random sketch as torch.svd_lowrank does, in the
// matrix's own precision; not recorded by autograd.
#include <cstdint>
#include <vector>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta {

/** The k largest singular triplets of a matrix a [m, n]: a ~= u diag(s) vh. */
struct SingularTriplets {
  Tensor u;   // [m, k], orthonormal columns
  Tensor s;   // [k], descending, non-negative
  Tensor vh;  // [k, n], orthonormal rows
  /** sum of every squared singular value (the squared Frobenius norm of a)
   * and of those past the k kept: ||a - u diag(s) vh||_F^2. */
  double total_square = 0, rest_square = 0;
};

/** The k largest singular triplets of the 2-d f32 or f64 matrix a [m, n],
 * 1 <= k <= min(m, n), in a's dtype and on its device. Each pair's sign is
 * fixed so that results do not depend on the library's choice: the entry of
 * largest magnitude in each column of u is positive (the first such entry
 * where two are equal). Throws std::invalid_argument naming what is wrong
 * for another rank or dtype, k out of range, or a non-finite entry. */
SingularTriplets top_singular_triplets(const Tensor& a, int64_t k);

/** top_singular_triplets(matrices[i], k[i]) of several matrices, the
 * decompositions on the CPU's threads at once (one matrix each; Eigen's SVD
 * is itself sequential): the same results as one at a time. Checks every
 * matrix before decomposing any. */
std::vector<SingularTriplets> top_singular_triplets(const std::vector<Tensor>& matrices,
                                                    const std::vector<int64_t>& k);

/** The k largest singular triplets of each matrix approximated as
 * torch.svd_lowrank(a, q=k, niter) finds them (Halko, Martinsson and Tropp
 * 2011): an orthonormal basis Q of a's range from a [n, k] Gaussian sketch
 * drawn from gens[i] in a's dtype, sharpened by niter power iterations, then
 * the exact SVD of Q^T a. Far cheaper than the full decomposition for
 * k << min(m, n), and close to it where a's spectrum falls past k (more
 * iterations, closer); rest_square is ||a - Q Q^T a||^2 exactly. The same
 * generators' states give the same results; the sign rule and the checks are
 * top_singular_triplets'. Throws std::invalid_argument for niter < 0 or
 * lists of different lengths. */
std::vector<SingularTriplets> approximate_singular_triplets(const std::vector<Tensor>& matrices,
                                                            const std::vector<int64_t>& k,
                                                            int64_t niter,
                                                            std::vector<Generator>& gens);

}  // namespace quanta
