#pragma once
// ResidualLFQ: LFQ layers on successive residuals, layer l with
// codebook_scale 2^-l; and its grouped form.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/step_stream.h"
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

class ResidualLFQ : public Module, public StepKeyed {
 public:
  /** Keys this layer's per-forward draws by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { dropout_gen_.pin(step); }
  explicit ResidualLFQ(ResidualLFQOptions opts);

  /** Quantizes x; indices [B, ..., num_quantizers] int64; loss [num_quantizers]
   * (each layer's weighted LFQ loss); terms summed over layers under the LFQ
   * names. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0);
  Tensor forward(const Tensor& x) override;
  /** forward with the last kept layer given (-1: none dropped). */
  QuantizeOutput forward_keep(const Tensor& x, const Tensor& mask, double inv_temperature,
                              int64_t last_kept);

  /** Per-layer codes [num_quantizers, ..., d] (scaled; index -1 gives zeros). */
  Tensor get_codes_from_indices(const Tensor& indices) const;
  /** project_out(sum of the codes). */
  Tensor get_output_from_indices(const Tensor& indices) const;
  /** Per-layer code tables [num_quantizers, codebook_size, d] (scaled). */
  Tensor codebooks() const;

  int64_t num_quantizers() const { return static_cast<int64_t>(layers_.size()); }
  LFQ& layer(int64_t i) { return *layers_.at(static_cast<size_t>(i)); }
  /** Sets every layer's batch-mean function (see TokenMean). */
  void set_token_mean(const TokenMean& fn);
  /** The next quantize-dropout draw. */
  int64_t draw_dropout();

 private:
  ResidualLFQOptions opts_;
  int64_t dim_ = 0;
  std::vector<std::shared_ptr<LFQ>> layers_;
  std::shared_ptr<Linear> project_in_, project_out_;
  StepStream dropout_gen_;
};

struct GroupedResidualLFQOptions {
  ResidualLFQOptions rlfq;
  int64_t groups = 1;
};

class GroupedResidualLFQ : public Module {
 public:
  explicit GroupedResidualLFQ(GroupedResidualLFQOptions opts);
  /** Concatenated outputs; indices [groups, B, ..., q]; loss [groups, q]. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0);
  Tensor forward(const Tensor& x) override;
  Tensor get_codes_from_indices(const Tensor& indices) const;
  Tensor get_output_from_indices(const Tensor& indices) const;
  int64_t groups() const { return static_cast<int64_t>(rlfqs_.size()); }
  ResidualLFQ& group(int64_t g) { return *rlfqs_.at(static_cast<size_t>(g)); }

 private:
  GroupedResidualLFQOptions opts_;
  std::vector<std::shared_ptr<ResidualLFQ>> rlfqs_;
};

}  // namespace quanta::quant
