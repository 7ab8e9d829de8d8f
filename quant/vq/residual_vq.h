#pragma once
// ResidualVQ: a stack of VectorQuantize layers, each quantizing what the
// previous ones left (SoundStream), with optional quantizer dropout; and
// GroupedResidualVQ, one ResidualVQ per slice of the feature dimension. The
// stack and the grouping are quant/residual.h and quant/grouped.h.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/grouped.h"
#include "quant/quantize_output.h"
#include "quant/residual.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {

/** ResidualVQ options (the reference's names and defaults). */
struct ResidualVQOptions {
  /** Feature size of the input (required). */
  int64_t dim = 0;
  /** Number of layers (required, or the length of codebook_sizes). */
  int64_t num_quantizers = 0;
  /** One codebook size for every layer, or one per layer. */
  std::vector<int64_t> codebook_sizes;
  /** Layer dimension; 0 = dim. Linear project_in / project_out otherwise. */
  int64_t codebook_dim = 0;
  /** Every layer quantizes with layer 0's codebook. */
  bool shared_codebook = false;
  /** In training, keep only layers 0..k for a random k per forward. */
  bool quantize_dropout = false;
  /** k is drawn uniformly from [cutoff, num_quantizers - 1]. */
  int64_t quantize_dropout_cutoff_index = 0;
  /** k is rounded up so that k + 1 is a multiple of this. */
  int64_t quantize_dropout_multiple_of = 1;
  bool accept_image_fmap = false;
  bool channel_last = true;
  /** Apply every codebook's statistics at the end of a training forward. */
  bool update_in_forward = true;
  /** Every other VectorQuantize option, for all layers (dim, codebook_size,
   * codebook_dim and update_in_forward are set per layer). */
  VectorQuantizeOptions layer;
};

class ResidualVQ : public Residual {
 public:
  /** Layers "layers.<i>", projections "project_in" / "project_out"; the
   * dropout stream "rvq.dropout" is keyed from `gen`. */
  ResidualVQ(const ResidualVQOptions& opts, Generator& gen);

  /** Quantizes `x` (layouts as VectorQuantize). Indices [B, N, Q] (-1 for
   * dropped layers and masked tokens), loss [Q] (0 for dropped layers), and
   * each VectorQuantize loss term stacked per layer. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }

  /** Per-layer codes of `indices` [..., q] (q <= Q; missing layers and -1
   * give zeros): [Q, ..., codebook_dim]. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** project_out of the summed codes: [..., dim]. */
  Tensor get_output_from_indices(const Tensor& indices) override;

  /** Applies every codebook's pending statistics (each shared one once). */
  void update_state();
  /** Turns update_in_forward on or off for the whole stack. */
  void set_update_in_forward(bool on);

  const ResidualVQOptions& options() const { return opts_; }
  int64_t num_quantizers() const override { return static_cast<int64_t>(layers_.size()); }
  VectorQuantize& layer(int64_t i) { return *layers_.at(static_cast<size_t>(i)); }
  bool has_projections() const { return project_in_ != nullptr; }

  using Residual::forward;

 protected:
  QuantizeOutput forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                              const QuantizeOptions& opts) override;

 private:
  ResidualVQOptions opts_;
  int64_t codebook_dim_;
  std::vector<std::shared_ptr<VectorQuantize>> layers_;
  std::shared_ptr<Module> project_in_, project_out_;

  // The public constructor validates `opts` once and delegates here.
  struct Validated {};
  ResidualVQ(const ResidualVQOptions& opts, Generator& gen, Validated);
};

/** GroupedResidualVQ options. */
struct GroupedResidualVQOptions {
  int64_t dim = 0;
  int64_t groups = 1;
  bool accept_image_fmap = false;
  bool channel_last = true;
  /** Options of each group's ResidualVQ (its dim is dim / groups). */
  ResidualVQOptions rvq;
};

class GroupedResidualVQ : public Grouped {
 public:
  /** Groups "rvqs.<g>". */
  GroupedResidualVQ(const GroupedResidualVQOptions& opts, Generator& gen);
  /** Quantized features concatenated over groups; indices [G, B, N, Q], loss
   * [G, Q], loss terms [G, Q]. One dropout decision for all groups. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }
  void update_state();
  void set_update_in_forward(bool on);
  /** Group `g`'s ResidualVQ. */
  ResidualVQ& group(int64_t g) { return static_cast<ResidualVQ&>(Grouped::group(g)); }

  using Grouped::forward;
};

}  // namespace quanta::quant
