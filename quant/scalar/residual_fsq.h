#pragma once
// ResidualFSQ: a stack of FSQ layers, each quantizing what the previous ones
// left over at a finer scale (layer l sees residual / L^-l); and its grouped
// form, which splits the features into groups with one ResidualFSQ each.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/step_stream.h"
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
  /** Training with grad enabled: keep only layers 0..k, k uniform in
   * [cutoff, num_quantizers - 1], drawn from the stream "rfsq.quantize_dropout"
   * of the module's Generator (fsq.seed); dropped layers give index -1. */
  bool quantize_dropout = false;
  int64_t quantize_dropout_cutoff_index = 0;
  int64_t quantize_dropout_multiple_of = 1;
  /** Input soft clamp tanh(x/v) v; unset: v = 1 + 1/(L-1) per dim when
   * bound_hard_clamp, else none. */
  std::optional<double> soft_clamp_input_value;
};

class ResidualFSQ : public Module, public StepKeyed {
 public:
  /** Keys this layer's per-forward draws by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { dropout_gen_.pin(step); }
  explicit ResidualFSQ(ResidualFSQOptions opts);

  /** Quantizes x (layouts as FSQ); indices [B, ..., num_quantizers] int32
   * (-1 for dropped layers); loss 0. `mask` is validated and otherwise unused. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask);
  Tensor forward(const Tensor& x) override;
  /** forward with the last kept layer given (-1: none dropped); the grouped
   * form draws it once for all groups. */
  QuantizeOutput forward_keep(const Tensor& x, const Tensor& mask, int64_t last_kept);

  /** Scaled per-layer codes [num_quantizers, ..., len(levels)] of indices
   * [..., num_quantizers] (index -1 gives zeros). */
  Tensor get_codes_from_indices(const Tensor& indices) const;
  /** project_out(sum of the layers' codes): the output of forward for these
   * indices, channel-last. */
  Tensor get_output_from_indices(const Tensor& indices) const;
  /** The layers' implicit codebooks, unscaled: [num_quantizers, codebook_size, d]. */
  Tensor codebooks() const;

  int64_t num_quantizers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t dim() const { return dim_; }
  int64_t codebook_size() const { return layers_.front()->codebook_size(); }
  /** The per-layer scales [num_quantizers, d] (L^-l). */
  const Tensor& scales() const { return scales_; }
  const FSQ& layer(int64_t i) const { return *layers_.at(static_cast<size_t>(i)); }
  /** The next quantize-dropout draw (what forward would use in training). */
  int64_t draw_dropout();

 private:
  ResidualFSQOptions opts_;
  int64_t dim_ = 0;
  std::vector<std::shared_ptr<FSQ>> layers_;
  std::shared_ptr<Linear> project_in_, project_out_;
  Tensor scales_;      // [Q, d]
  Tensor soft_clamp_;  // [d] or undefined
  StepStream dropout_gen_;
};

/** GroupedResidualFSQ settings: the features split into `groups` equal chunks. */
struct GroupedResidualFSQOptions {
  ResidualFSQOptions rfsq;
  int64_t groups = 1;
};

class GroupedResidualFSQ : public Module {
 public:
  explicit GroupedResidualFSQ(GroupedResidualFSQOptions opts);
  /** Concatenated group outputs; indices [groups, B, ..., num_quantizers]. All
   * groups drop the same layers (one draw per forward). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask);
  Tensor forward(const Tensor& x) override;
  /** Codes per group: [groups, num_quantizers, ..., d] of indices [groups, ..., q]. */
  Tensor get_codes_from_indices(const Tensor& indices) const;
  /** Concatenated group outputs for indices [groups, ..., q]. */
  Tensor get_output_from_indices(const Tensor& indices) const;
  int64_t groups() const { return static_cast<int64_t>(rfsqs_.size()); }

 private:
  GroupedResidualFSQOptions opts_;
  std::vector<std::shared_ptr<ResidualFSQ>> rfsqs_;
};

}  // namespace quanta::quant
