#pragma once
// CorDA's adapter start (Yang et al. 2024, "CorDA: Context-Oriented
// Decomposition Adaptation"), as PEFT 0.21's preprocess_corda and
// corda_init compute it: the weight is decomposed with the covariance of
// the inputs it sees, so that the adapters take the directions that matter
// for that data (ipm) or those that matter least, leaving the base's
// knowledge where the data lives (kpm). Like PiSSA's, the start is taken
// out of the weight and the residual is what an NF4 base quantizes.
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "quant/nf4/residual_init.h"

namespace quanta::quant {

/** Which singular triplets of W C the adapters take: PEFT's corda_method.
 * ipm (instruction-previewed): the r largest, for the fastest fit of the
 * task; kpm (knowledge-preserved): the r smallest, to keep what the base
 * knows of the data the covariance came from. */
enum class CordaMethod { ipm, kpm };

/** PEFT's spelling: "ipm", "kpm". */
const char* corda_method_name(CordaMethod method);
/** The inverse; throws std::invalid_argument naming the two values. */
CordaMethod parse_corda_method(const std::string& text);

/** CorDA's starts. covariances[i] is layer i's input covariance [in, in]
 * (llm::corda_covariances). Damped as PEFT does it, C' = C + d mean(diag C)
 * I with d = 0.01 doubled until ||C' inv(C') - I||_F < 0.05; W C' = U S Vh;
 * V = (Vh inv(C'))^T; with the method's r triplets and s = S / scaling,
 * A = sqrt(s) V^T and B = U sqrt(s), so that scaling B A = U S Vh inv(C')
 * restricted to them, and the residual is weight - scaling B A. Computed in
 * f64 on the host (PEFT: f32), the layers on the CPU's threads at once; the
 * results in f32 (f64 for an f64 weight) on the weight's device. A
 * triplet's sign makes the largest-magnitude entry of its U column positive
 * (top_singular_triplets' rule). Throws std::invalid_argument naming the
 * layer (its index) for a rank outside [1, min(out, in)], a covariance that
 * is not [in, in], has a non-finite entry, or whose diagonal's mean is not
 * positive (inputs that were all zero). */
std::vector<ResidualStart> corda_starts(const std::vector<ResidualStartLayer>& layers,
                                        const std::vector<Tensor>& covariances, CordaMethod method);

}  // namespace quanta::quant
