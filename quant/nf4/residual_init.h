#pragma once
// Adapter starts that take their part out of the frozen weight: the adapters
// begin as the weight's leading directions and the base keeps the rest, so
// base + adapters is still the model at step 0. PiSSA (Meng et al. 2024,
// "Principal Singular values and Singular vectors Adaptation": the largest
// singular triplets) and OLoRA (Büyükakyüz 2024: the leading columns of a QR
// factorization), as PEFT's init_lora_weights "pissa", "pissa_niter_N" and
// "olora" compute them. Over an NF4 base the residual is what gets quantized
// (QPiSSA's recipe: PiSSA also shrinks the quantization error).
#include <cstdint>
#include <vector>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta::quant {

/** One layer to start: its float weight [out, in], the adapters' rank and
 * their scaling (lora_alpha / r, or / sqrt(r) with rsLoRA). */
struct ResidualStartLayer {
  Tensor weight;
  int64_t rank = 0;
  double scaling = 1;
  /** The dtype the start's factors are rounded to before the residual is
   * formed: PEFT leaves them in the layer's dtype (bf16 in a bf16 model)
   * even where the adapters then train in f32. f32 (or f64) keeps them. */
  DType factor_dtype = DType::f32;
};

/** What a start gives one layer, in f32 (f64 for an f64 weight) on the
 * weight's device: the factors taken out of the weight, the residual the
 * base is to hold (weight - scaling * taken_B taken_A), and the adapters'
 * start, those factors rounded through factor_dtype (PEFT forms the
 * residual before it rounds them). */
struct ResidualStart {
  Tensor lora_A;    // [rank, in]
  Tensor lora_B;    // [out, rank]
  Tensor taken_A;   // [rank, in]
  Tensor taken_B;   // [out, rank]
  Tensor residual;  // [out, in]
};

/** PiSSA: with the weight's rank largest singular triplets U S Vh,
 * A = sqrt(S / scaling) Vh and B = U sqrt(S / scaling), so that scaling B A
 * is U S Vh and the residual holds the rest of the spectrum. niter < 0: the
 * exact decomposition (PEFT's "pissa"); niter >= 0: torch.svd_lowrank's
 * approximation with niter power iterations (approximate_singular_triplets,
 * PEFT's "pissa_niter_<niter>"), layer i's sketch drawn from (*gens)[i].
 * The layers' decompositions run on the CPU's threads at once: give about
 * as many as there are threads. Singular vectors' signs follow
 * top_singular_triplets. Throws std::invalid_argument naming the layer (its
 * index) for a rank outside [1, min(out, in)] or a weight that is not a
 * matrix. */
std::vector<ResidualStart> pissa_starts(const std::vector<ResidualStartLayer>& layers,
                                        int64_t niter = -1, std::vector<Generator>* gens = nullptr);

/** OLoRA: with the thin QR weight = Q R, A = R's first rank rows and B = Q's
 * first rank columns, whatever the scaling (PEFT's rule: the residual is
 * weight - scaling Q_r R_r, the weight's leading part only when the scaling
 * is 1). QRs on the CPU's threads at once, as pissa_starts. */
std::vector<ResidualStart> olora_starts(const std::vector<ResidualStartLayer>& layers);

/** The start given rather than computed (the factors taken out, as a saved
 * folder keeps them): the residual weight - scaling b a, in the weight's
 * decomposition dtype (f32, or f64 for an f64 weight) with a and b converted
 * to it, the same as the start that computed them left. Throws
 * std::invalid_argument naming the shapes when a [rank, in] and b
 * [out, rank] do not fit the weight. */
ResidualStart given_start(const ResidualStartLayer& layer, const Tensor& a, const Tensor& b);

}  // namespace quanta::quant
