#pragma once
// The codebook transform hook of a VectorQuantize layer: a map from its
// codes to the codes it quantizes with. Two features of vector-quantize-
// pytorch 1.32 are this one hook: FVQ's vq_bridge (a module over the codes,
// the same codebook for every token) and QINCo's implicit neural codebook
// (ResidualVQ's MLP over each code and the token's running quantized sum, a
// codebook per token). Distances, the chosen codes and their gradient are
// then the layer's own, whichever transform made the codes.
#include <cstdint>
#include <functional>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"

namespace quanta::quant {

/** The hook: the layer's codes [G, K, d] and this forward's condition (one
 * row per token, [T, d]; undefined when the caller gave none) to the codes
 * it quantizes with: [G, K, d] for every token alike, or [G, T, K, d], one
 * codebook per token. Differentiable in both. */
using CodebookTransform = std::function<Tensor(const Tensor& codes, const Tensor& condition)>;

/** QINCo's codebook MLP (vector-quantize-pytorch's residual_vq.MLP): a code
 * c and a condition z give proj_in([z, c]) followed by `depth` residual
 * blocks x + Linear(SiLU(Linear(x))). State keys as the reference's:
 * proj_in.*, layers.<i>.0.*, layers.<i>.2.*. The reference's l2norm_output
 * follows use_cosine_sim, which it refuses with the learnable codebook QINCo
 * needs, so it is never on and is left out. */
class ImplicitCodebookMLP : public Module {
 public:
  /** dim d, hidden width (0 = d) and depth, drawn from `gen` in the
   * reference's order (proj_in, then each block's two Linears). */
  ImplicitCodebookMLP(int64_t dim, int64_t dim_hidden, int64_t depth, Generator& gen);
  /** codes [G, K, d] and condition [T, d] -> per-token codes [G, T, K, d]. */
  Tensor forward(const Tensor& codes, const Tensor& condition);

 private:
  int64_t dim_;
  std::shared_ptr<Linear> proj_in_;
  std::vector<std::shared_ptr<Sequential>> blocks_;
};

}  // namespace quanta::quant
