#pragma once
// ResidualLFQ: LFQ layers on successive residuals, layer l with
// codebook_scale 2^-l; and its grouped form. Both are made from
// LayerTraits<LFQ> (quant/layer_traits.h).
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/grouped_of.h"
#include "quant/layer_traits.h"
#include "quant/quantize_output.h"
#include "quant/residual.h"
#include "quant/residual_of.h"
#include "quant/scalar/lfq.h"

namespace quanta::quant {

/** ResidualLFQ settings. `lfq` configures every layer: its dim is the input
 * dim, codebook_size the per-layer codebook (num_codebooks must be 1); layer l
 * uses codebook_scale 2^-l and soft_clamp_input_value / 2^l. */
struct ResidualLFQOptions {
  LFQOptions lfq;
  int64_t num_quantizers = 1;
  /** As ResidualFSQ; dropped layers give index -1 and loss 0. */
  bool quantize_dropout = false;
  int64_t quantize_dropout_cutoff_index = 0;
  int64_t quantize_dropout_multiple_of = 1;
};

/** GroupedResidualLFQ settings: the features split into `groups` equal chunks. */
struct GroupedResidualLFQOptions {
  ResidualLFQOptions rlfq;
  int64_t groups = 1;
};

/** How a stack of LFQ layers is made (quant/layer_traits.h). */
template <>
struct LayerTraits<LFQ> {
  using Options = ResidualLFQOptions;
  using GroupedOptions = GroupedResidualLFQOptions;
  static constexpr const char* name = "ResidualLFQ";
  static constexpr const char* grouped_name = "GroupedResidualLFQ";
  static constexpr DType index_dtype = DType::i64;
  static constexpr MemberLosses losses = MemberLosses::summed;

  static StackPlan plan(Options& opts);
  static std::shared_ptr<LFQ> make_layer(const Options& opts, const StackPlan& plan, int64_t i,
                                         const std::vector<std::shared_ptr<LFQ>>& built,
                                         Generator& gen);
  static QuantizeOutput quantize(LFQ& layer, const Tensor& residual, const Tensor& token_mask,
                                 const QuantizeOptions& opts);
  static Tensor codes(LFQ& layer, const Tensor& indices);
  static GroupedLayout grouped_layout(const GroupedOptions& opts);
  static Options group_options(const GroupedOptions& opts);
};

extern template class ResidualOf<LFQ>;

class ResidualLFQ : public ResidualOf<LFQ> {
 public:
  /** Builds the stack from `gen` (quant/layer_traits.h's seeding). */
  using ResidualOf::ResidualOf;

  /** Quantizes x; indices [B, ..., num_quantizers] int64; loss [num_quantizers]
   * (each layer's weighted LFQ loss); terms summed over layers under the LFQ
   * names. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0) {
    return forward(x, mask, QuantizeOptions{.inv_temperature = inv_temperature});
  }
  using ResidualOf::forward;
  Tensor forward(const Tensor& x) override;

  /** Per-layer code tables [num_quantizers, codebook_size, d] (scaled). */
  Tensor codebooks() const;
  /** Sets every layer's batch-mean function (see TokenMean). */
  void set_token_mean(const TokenMean& fn);
};

extern template class GroupedOf<LFQ, ResidualLFQ>;

class GroupedResidualLFQ : public GroupedOf<LFQ, ResidualLFQ> {
 public:
  /** Builds the groups one after another from `gen`. Concatenated outputs;
   * indices [groups, B, ..., q]; loss [groups, q]; terms summed over groups. */
  using GroupedOf::GroupedOf;
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0) {
    return forward(x, mask, QuantizeOptions{.inv_temperature = inv_temperature});
  }
  using GroupedOf::forward;
  Tensor forward(const Tensor& x) override;
};

}  // namespace quanta::quant
