#pragma once
// What the residual stack and the grouped form need to know about a layer
// family: a family specialises LayerTraits<Layer> next to its layer and gets
// ResidualOf<Layer> (quant/residual_of.h) and GroupedOf<Layer>
// (quant/grouped_of.h) from it. ResidualVQ, ResidualSimVQ, ResidualFSQ and
// ResidualLFQ are those stacks with a few family methods added.
//
// The contract, for LayerTraits<L>:
//   using Options = ...;          the stack's options
//   using GroupedOptions = ...;   the grouped form's (only if it has one)
//   static constexpr const char* name = "ResidualX", *grouped_name = ...;
//   static constexpr DType index_dtype;        of the stack's indices
//   static constexpr MemberLosses losses;      how layer losses combine
//   static StackPlan plan(Options& o);         validates o (filling what it
//                                              implies) and sizes the stack
//   static std::shared_ptr<L> make_layer(const Options&, const StackPlan&,
//       int64_t i, const std::vector<std::shared_ptr<L>>& built, Generator&);
//   static QuantizeOutput quantize(L&, const Tensor& residual,
//       const Tensor& token_mask, const QuantizeOptions&);
//   static Tensor codes(L&, const Tensor& indices);   codes [..., d] of valid
//                                                     indices (>= 0)
// and, for the grouped form:
//   static GroupedLayout grouped_layout(const GroupedOptions&);
//   static Options group_options(const GroupedOptions&);   one group's stack
// Optional hooks (used when present):
//   static Tensor level_scales(const Options&, const StackPlan&);
//       [Q, d]: layer q quantizes residual / scale_q and its codes are
//       scaled back (ResidualFSQ's L^-q)
//   static Tensor input_bound(const Options&, const StackPlan&);
//   static Tensor bound_input(const Tensor& z, const Tensor& bound);
//       a clamp on the stack's tokens before layer 0 (undefined bound: none)
//   static void after_forward(const Options&, bool training,
//       const std::vector<std::shared_ptr<L>>& layers);
//       once after the layers ran (ResidualVQ's shared-codebook update)
//   static std::optional<QuantizeOutput> search(const Options&, bool training,
//       const std::vector<std::shared_ptr<L>>& layers, const Tensor& tokens,
//       const Tensor& keep, int64_t last_kept);
//       replaces the greedy residual loop when it returns a value (ResidualVQ's
//       beam search)
//   static double quant_grad_frac(const Options&);
//       the fraction of later layers' gradient that reaches a layer's output
//       (residual_quantize's grad_frac; 0 without the hook)
//   static void route_output(const Options&, bool training,
//       const std::vector<std::shared_ptr<L>>& layers, const Tensor& tokens,
//       QuantizeOutput& out);
//       after after_forward: replaces out.quantized (the summed layers'
//       output, tokens [B, N, d]) given the stack's input tokens (DiVeQ)
//   static bool conditions_layers(const Options&);
//       true: layer i > 0 quantizes with QuantizeOptions::condition set to
//       the sum of layers 0..i-1's outputs, and its codes are looked up with
//       the sum of the earlier codes as condition, through
//       static Tensor codes(L&, const Tensor& indices, const Tensor& condition)
//       (ResidualVQ's implicit neural codebook)
//   static MaskedOutput masked_output(const Options&, const Tensor& keep);
//       what the stack outputs at masked tokens after project_out (without
//       the hook: whatever the layers gave there, through project_out)
//
// Seeding, the same for every family: the stack builds its projections (when
// its layers are narrower than its input), then layer 0, 1, ... from the
// generator it is given, each as the layer would be built alone, then takes
// its quantize-dropout stream's seed; a grouped form builds its stacks one
// after another from its generator.
#include <cstdint>

#include "quant/quantize_dropout.h"

namespace quanta::quant {

template <class Layer>
struct LayerTraits;

/** A stack's sizes and layout, worked out from its options by LayerTraits::plan. */
struct StackPlan {
  /** Input features (D). */
  int64_t dim = 0;
  /** Each layer's features (d); Linear projections D -> d -> D when d != D. */
  int64_t layer_dim = 0;
  int64_t num_quantizers = 0;
  /** Tokens [B, N, D]; false: [B, D, N]. Rank >= 4 inputs are feature maps. */
  bool channel_last = true;
  /** Accept feature maps [B, D, H, W...] (else they are an error). */
  bool accept_image_fmap = true;
  bool projection_bias = true;
  QuantizeDropout dropout{};
};

}  // namespace quanta::quant
