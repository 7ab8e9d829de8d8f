#pragma once
// SimVQ (Zhu et al., 2024): a frozen random codebook seen through a learned
// linear transform, so every code moves with each gradient step; and
// ResidualSimVQ, a residual stack of them (from LayerTraits<SimVQ>). As
// vector-quantize-pytorch 1.31.0.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/layer_traits.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/residual.h"
#include "quant/residual_of.h"

namespace quanta::quant {

/** SimVQ options (the reference's names and defaults). */
struct SimVQOptions {
  int64_t dim = 0;
  int64_t codebook_size = 0;
  /** Width of the frozen codebook; 0 = dim. */
  int64_t frozen_codebook_dim = 0;
  /** Features at dim 1 ([B, D, N] or [B, D, H, W]). */
  bool channel_first = false;
  /** Rotation trick gradient, else the straight-through estimator. */
  bool rotation_trick = true;
  /** Weight of mse(x, sg(q)) inside the commitment loss. */
  double input_to_quantize_commit_loss_weight = 0.25;
  double commitment_weight = 1.0;
};

class SimVQ : public SingleLayerQuantizer {
 public:
  /** Buffer "frozen_codebook" [K, Df] ~ N(0, 1/Df) and parameter
   * "code_transform.weight" [D, Df] (Linear without bias), drawn from `gen`. */
  SimVQ(const SimVQOptions& opts, Generator& gen);
  /** Nearest transformed code for every token. loss = commitment_weight *
   * (mse(sg(x), q) + w * mse(x, sg(q))) (train and eval, as the reference);
   * indices [B, N...]. The transform learns through the loss. `mask` (bool,
   * token shape) marks valid tokens: the others get zero output, index -1 and
   * no loss. `opts` changes nothing (one layer). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  /** forward(x, mask, {}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }
  /** The transformed codes [..., D] of `indices` [...] (-1 gives zeros),
   * channel-last whatever the layout. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** get_codes_from_indices: SimVQ has no projection after the codes. */
  Tensor get_output_from_indices(const Tensor& indices) override;
  /** The transformed codebook [K, D] (differentiable in the transform). */
  Tensor codebook();
  /** Codes of `indices` [...] as [..., D] (channel-first layouts move D to
   * dim 1 as the reference does). */
  Tensor indices_to_codes(const Tensor& indices);
  const SimVQOptions& options() const { return opts_; }
  int64_t codebook_size() const override { return opts_.codebook_size; }
  int64_t num_codebooks() const override { return 1; }

 private:
  SimVQOptions opts_;
  Tensor frozen_;
  std::shared_ptr<Linear> transform_;
};

/** ResidualSimVQ options. */
struct ResidualSimVQOptions {
  int64_t dim = 0;
  int64_t num_quantizers = 0;
  int64_t codebook_size = 0;
  bool quantize_dropout = false;
  int64_t quantize_dropout_cutoff_index = 0;
  int64_t quantize_dropout_multiple_of = 1;
  /** Input [B, D, ...] (features at dim 1). */
  bool accept_image_fmap = false;
  bool rotation_trick = true;
  /** Per-layer options (dim, codebook_size, rotation_trick, channel_first
   * are set from the fields above). */
  SimVQOptions layer;
};

/** How a stack of SimVQ layers is made (quant/layer_traits.h). */
template <>
struct LayerTraits<SimVQ> {
  using Options = ResidualSimVQOptions;
  static constexpr const char* name = "ResidualSimVQ";
  static constexpr DType index_dtype = DType::i64;
  static constexpr MemberLosses losses = MemberLosses::stacked;

  static StackPlan plan(Options& opts);
  static std::shared_ptr<SimVQ> make_layer(const Options& opts, const StackPlan& plan, int64_t i,
                                           const std::vector<std::shared_ptr<SimVQ>>& built,
                                           Generator& gen);
  static QuantizeOutput quantize(SimVQ& layer, const Tensor& residual, const Tensor& token_mask,
                                 const QuantizeOptions& opts);
  static Tensor codes(SimVQ& layer, const Tensor& indices);
};

extern template class ResidualOf<SimVQ>;

class ResidualSimVQ : public ResidualOf<SimVQ> {
 public:
  /** Layers "layers.<i>", built from `gen` (quant/layer_traits.h's seeding). */
  using ResidualOf::ResidualOf;
  /** Sum of the layers' codes; indices [..., Q] (-1 dropped), loss [Q] and
   * the term "commitment" [Q]. `mask` as SimVQ's. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }
  using ResidualOf::forward;
};

}  // namespace quanta::quant
