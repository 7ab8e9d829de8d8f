#pragma once
// LatentQuantize (latent_quantization.py of the reference): each code
// dimension snaps to the nearest of its own grid of values, initialised to
// L_i values from -1/2 with 0 among them (linspace(-1/2, 1/2, L_i) for odd
// L_i, i / L_i - 1/2 for even); the index packs the per-dimension positions with
// the basis cumprod([1, L_0, ...]) as FSQ does.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"

namespace quanta::quant {

struct LatentQuantizeOptions {
  /** Grid sizes per code dimension (each >= 2); one size with codebook_dim
   * > 1 is that size for every dimension. */
  std::vector<int64_t> levels;
  /** Code dimensions; 0 = len(levels). */
  int64_t codebook_dim = 0;
  /** Input features; 0 = len(levels) * num_codebooks. */
  int64_t dim = 0;
  double commitment_loss_weight = 0.1;
  double quantization_loss_weight = 0.1;
  int64_t num_codebooks = 1;
  /** Default num_codebooks > 1. */
  std::optional<bool> keep_num_codebooks_dim;
  /** Register the value grids as parameters ("values_per_latent.<i>"). As in
   * the reference they receive no gradient from forward (the straight-through
   * output has none); they are trainable only by code that updates them. */
  bool optimize_values = true;
};

class LatentQuantize : public SingleLayerQuantizer {
 public:
  /** Builds the layer seeded with the next 64 bits of `gen` (draw_seed), as
   * every quantizer family is: that seed keys the projections' initialisation. */
  LatentQuantize(LatentQuantizeOptions opts, Generator& gen);

  /** Quantizes x ([B, D], [B, N, D] or [B, D, H, W...]); indices int32.
   * loss (train mode) = commitment_loss_weight * mse(out, sg(x)) +
   * quantization_loss_weight * mse(sg(out), x) between the input and the
   * output (terms "commitment", "quantization"); 0 in eval. `mask` is
   * validated and otherwise unused; so is `opts`. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  /** forward(x, mask, {}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  Tensor forward(const Tensor& x) override;

  /** Nearest grid value per dimension with a straight-through gradient:
   * z [..., d] -> codes [..., d]. */
  Tensor quantize(const Tensor& z) const;
  /** Codes or inputs [..., d] -> the index of their nearest grid point [...] (i64). */
  Tensor codes_to_indices(const Tensor& z) const;
  /** Indices as forward returns them -> codes [..., C * d] (project_out when asked). */
  Tensor indices_to_codes(const Tensor& indices, bool project_out = true) const;

  /** indices_to_codes(indices, false): [..., C * d]. */
  Tensor get_codes_from_indices(const Tensor& indices) override {
    return indices_to_codes(indices, false);
  }
  /** indices_to_codes(indices): [..., dim]. */
  Tensor get_output_from_indices(const Tensor& indices) override {
    return indices_to_codes(indices, true);
  }

  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return opts_.num_codebooks; }
  /** Grid values of dimension i: [levels[i]]. */
  const Tensor& values(int64_t i) const { return values_.at(static_cast<size_t>(i)); }

 private:
  LatentQuantizeOptions opts_;
  int64_t dim_ = 0, codebook_size_ = 1;
  bool keep_codebook_dim_ = false;
  std::vector<int64_t> basis_;
  std::vector<Tensor> values_;
  std::shared_ptr<Linear> project_in_, project_out_;
};

}  // namespace quanta::quant
