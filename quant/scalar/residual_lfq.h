#pragma once
// ResidualLFQ: LFQ layers on successive residuals, layer l with
// codebook_scale 2^-l; and its grouped form. The stack and the grouping are
// quant/residual.h and quant/grouped.h.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/grouped.h"
#include "quant/quantize_output.h"
#include "quant/residual.h"
#include "quant/scalar/lfq.h"

namespace quanta::quant {

/** ResidualLFQ settings. `lfq` configures every layer: its dim is the input
 * dim, codebook_size the per-layer codebook (num_codebooks must be 1); layer l
 * uses codebook_scale 2^-l and soft_clamp_input_value / 2^l. */
struct ResidualLFQOptions {
  LFQOptions lfq;
  int64_t num_quantizers = 1;
  /** As ResidualFSQ (stream "rlfq.quantize_dropout"); dropped layers give
   * index -1 and loss 0. */
  bool quantize_dropout = false;
  int64_t quantize_dropout_cutoff_index = 0;
  int64_t quantize_dropout_multiple_of = 1;
};

class ResidualLFQ : public Residual {
 public:
  /** Builds the stack seeded with the next 64 bits of `gen` (draw_seed): that
   * seed keys the projections, the dropout stream and each layer's seed. */
  ResidualLFQ(ResidualLFQOptions opts, Generator& gen);

  /** Quantizes x; indices [B, ..., num_quantizers] int64; loss [num_quantizers]
   * (each layer's weighted LFQ loss); terms summed over layers under the LFQ
   * names. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0) {
    return forward(x, mask, QuantizeOptions{.inv_temperature = inv_temperature});
  }
  Tensor forward(const Tensor& x) override;

  /** Per-layer codes [num_quantizers, ..., d] (scaled; missing layers and
   * index -1 give zeros). */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** project_out(sum of the codes). */
  Tensor get_output_from_indices(const Tensor& indices) override;
  /** Per-layer code tables [num_quantizers, codebook_size, d] (scaled). */
  Tensor codebooks() const;

  int64_t num_quantizers() const override { return static_cast<int64_t>(layers_.size()); }
  LFQ& layer(int64_t i) { return *layers_.at(static_cast<size_t>(i)); }
  /** Sets every layer's batch-mean function (see TokenMean). */
  void set_token_mean(const TokenMean& fn);

  using Residual::forward;

 protected:
  QuantizeOutput forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                              const QuantizeOptions& opts) override;

 private:
  // A grouped wrapper seeds each stack from its own seed (detail::child_seed).
  friend class GroupedResidualLFQ;
  ResidualLFQ(ResidualLFQOptions opts, uint64_t seed);

  ResidualLFQOptions opts_;
  int64_t dim_ = 0;
  std::vector<std::shared_ptr<LFQ>> layers_;
  std::shared_ptr<Linear> project_in_, project_out_;
};

struct GroupedResidualLFQOptions {
  ResidualLFQOptions rlfq;
  int64_t groups = 1;
};

class GroupedResidualLFQ : public Grouped {
 public:
  /** Builds the groups from the next 64 bits of `gen` (draw_seed): group g's
   * stack is seeded with child_seed(seed, "group<g>"). */
  GroupedResidualLFQ(GroupedResidualLFQOptions opts, Generator& gen);
  /** Concatenated outputs; indices [groups, B, ..., q]; loss [groups, q];
   * terms summed over groups. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0) {
    return forward(x, mask, QuantizeOptions{.inv_temperature = inv_temperature});
  }
  Tensor forward(const Tensor& x) override;
  /** Group `g`'s ResidualLFQ. */
  ResidualLFQ& group(int64_t g) { return static_cast<ResidualLFQ&>(Grouped::group(g)); }

  using Grouped::forward;
};

}  // namespace quanta::quant
