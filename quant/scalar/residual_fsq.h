#pragma once
// ResidualFSQ: a stack of FSQ layers, each quantizing what the previous ones
// left over at a finer scale (layer l sees residual / L^-l); and its grouped
// form, which splits the features into groups with one ResidualFSQ each. Both
// are made from LayerTraits<FSQ> (quant/layer_traits.h).
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/grouped_of.h"
#include "quant/layer_traits.h"
#include "quant/quantize_output.h"
#include "quant/residual.h"
#include "quant/residual_of.h"
#include "quant/scalar/fsq.h"

namespace quanta::quant {

/** ResidualFSQ settings. `fsq` configures every layer (its dim is the input
 * dim; the layers themselves work on len(levels) features and always use
 * preserve_symmetry); bound_hard_clamp defaults to true here as in the
 * reference. */
struct ResidualFSQOptions {
  FSQOptions fsq = [] {
    FSQOptions o;
    o.bound_hard_clamp = true;
    return o;
  }();
  int64_t num_quantizers = 1;
  /** In training keep only layers 0..k (QuantizeDropout's rule), drawn from
   * the stack's dropout stream; dropped layers give index -1. */
  bool quantize_dropout = false;
  int64_t quantize_dropout_cutoff_index = 0;
  int64_t quantize_dropout_multiple_of = 1;
  /** Input soft clamp tanh(x/v) v; unset: v = 1 + 1/(L-1) per dim when
   * bound_hard_clamp, else none. */
  std::optional<double> soft_clamp_input_value;
};

/** GroupedResidualFSQ settings: the features split into `groups` equal chunks. */
struct GroupedResidualFSQOptions {
  ResidualFSQOptions rfsq;
  int64_t groups = 1;
};

/** How a stack of FSQ layers is made (quant/layer_traits.h). */
template <>
struct LayerTraits<FSQ> {
  using Options = ResidualFSQOptions;
  using GroupedOptions = GroupedResidualFSQOptions;
  static constexpr const char* name = "ResidualFSQ";
  static constexpr const char* grouped_name = "GroupedResidualFSQ";
  static constexpr DType index_dtype = DType::i32;
  static constexpr MemberLosses losses = MemberLosses::none;

  static StackPlan plan(Options& opts);
  static std::shared_ptr<FSQ> make_layer(const Options& opts, const StackPlan& plan, int64_t i,
                                         const std::vector<std::shared_ptr<FSQ>>& built,
                                         Generator& gen);
  static QuantizeOutput quantize(FSQ& layer, const Tensor& residual, const Tensor& token_mask,
                                 const QuantizeOptions& opts);
  static Tensor codes(FSQ& layer, const Tensor& indices);
  /** L^-q per dim: [Q, d]. */
  static Tensor level_scales(const Options& opts, const StackPlan& plan);
  /** The soft clamp's v per dim, or undefined (see ResidualFSQOptions). */
  static Tensor input_bound(const Options& opts, const StackPlan& plan);
  static Tensor bound_input(const Tensor& z, const Tensor& bound);
  static GroupedLayout grouped_layout(const GroupedOptions& opts);
  static Options group_options(const GroupedOptions& opts);
};

extern template class ResidualOf<FSQ>;

class ResidualFSQ : public ResidualOf<FSQ> {
 public:
  /** Builds the stack from `gen` (quant/layer_traits.h's seeding). */
  using ResidualOf::ResidualOf;

  /** Quantizes x (layouts as FSQ); indices [B, ..., num_quantizers] int32
   * (-1 for dropped layers); loss 0. `mask` is validated and otherwise unused. */
  using ResidualOf::forward;
  Tensor forward(const Tensor& x) override;

  /** The layers' implicit codebooks, unscaled: [num_quantizers, codebook_size, d]. */
  Tensor codebooks() const;
  /** The per-layer scales [num_quantizers, d] (L^-l). */
  const Tensor& scales() const { return level_scales(); }
};

extern template class GroupedOf<FSQ, ResidualFSQ>;

class GroupedResidualFSQ : public GroupedOf<FSQ, ResidualFSQ> {
 public:
  /** Builds the groups one after another from `gen`; all of them drop the
   * same layers (one draw per forward). Indices [groups, B, ..., num_quantizers]. */
  using GroupedOf::forward;
  using GroupedOf::GroupedOf;
  Tensor forward(const Tensor& x) override;
};

}  // namespace quanta::quant
