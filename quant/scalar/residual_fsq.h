#pragma once
// ResidualFSQ: a stack of FSQ layers, each quantizing what the previous ones
// left over at a finer scale (layer l sees residual / L^-l); and its grouped
// form, which splits the features into groups with one ResidualFSQ each. The
// stack and the grouping are quant/residual.h and quant/grouped.h.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/grouped.h"
#include "quant/quantize_output.h"
#include "quant/residual.h"
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
   * the stream "rfsq.quantize_dropout" of the stack's seed; dropped layers give
   * index -1. */
  bool quantize_dropout = false;
  int64_t quantize_dropout_cutoff_index = 0;
  int64_t quantize_dropout_multiple_of = 1;
  /** Input soft clamp tanh(x/v) v; unset: v = 1 + 1/(L-1) per dim when
   * bound_hard_clamp, else none. */
  std::optional<double> soft_clamp_input_value;
};

class ResidualFSQ : public Residual {
 public:
  /** Builds the stack seeded with the next 64 bits of `gen` (draw_seed): that
   * seed keys the projections, the dropout stream and each layer's seed. */
  ResidualFSQ(ResidualFSQOptions opts, Generator& gen);

  /** Quantizes x (layouts as FSQ); indices [B, ..., num_quantizers] int32
   * (-1 for dropped layers); loss 0. `mask` is validated and otherwise unused. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  Tensor forward(const Tensor& x) override;

  /** Scaled per-layer codes [num_quantizers, ..., len(levels)] of indices
   * [..., q] (q <= num_quantizers; missing layers and -1 give zeros). */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** project_out(sum of the layers' codes): the output of forward for these
   * indices, channel-last. */
  Tensor get_output_from_indices(const Tensor& indices) override;
  /** The layers' implicit codebooks, unscaled: [num_quantizers, codebook_size, d]. */
  Tensor codebooks() const;

  int64_t num_quantizers() const override { return static_cast<int64_t>(layers_.size()); }
  int64_t dim() const { return dim_; }
  int64_t codebook_size() const { return layers_.front()->codebook_size(); }
  /** The per-layer scales [num_quantizers, d] (L^-l). */
  const Tensor& scales() const { return scales_; }
  const FSQ& layer(int64_t i) const { return *layers_.at(static_cast<size_t>(i)); }

  using Residual::forward;

 protected:
  QuantizeOutput forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                              const QuantizeOptions& opts) override;

 private:
  // A grouped wrapper seeds each stack from its own seed (detail::child_seed).
  friend class GroupedResidualFSQ;
  ResidualFSQ(ResidualFSQOptions opts, uint64_t seed);

  ResidualFSQOptions opts_;
  int64_t dim_ = 0;
  std::vector<std::shared_ptr<FSQ>> layers_;
  std::shared_ptr<Linear> project_in_, project_out_;
  Tensor scales_;      // [Q, d]
  Tensor soft_clamp_;  // [d] or undefined
};

/** GroupedResidualFSQ settings: the features split into `groups` equal chunks. */
struct GroupedResidualFSQOptions {
  ResidualFSQOptions rfsq;
  int64_t groups = 1;
};

class GroupedResidualFSQ : public Grouped {
 public:
  /** Builds the groups from the next 64 bits of `gen` (draw_seed): group g's
   * stack is seeded with child_seed(seed, "group<g>"). */
  GroupedResidualFSQ(GroupedResidualFSQOptions opts, Generator& gen);
  /** Concatenated group outputs; indices [groups, B, ..., num_quantizers]. All
   * groups drop the same layers (one draw per forward). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  Tensor forward(const Tensor& x) override;
  /** Group `g`'s ResidualFSQ. */
  ResidualFSQ& group(int64_t g) { return static_cast<ResidualFSQ&>(Grouped::group(g)); }

  using Grouped::forward;
};

}  // namespace quanta::quant
