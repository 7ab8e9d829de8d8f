#pragma once
// FSQ: finite scalar quantization (Mentzer et al. 2023). Each of the d code
// dimensions is bounded and rounded to one of L_i levels, so the codebook is
// the implicit grid of prod(L_i) points and there is nothing to learn but the
// optional projections. Behaviour follows vector-quantize-pytorch 1.31.0.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/step_stream.h"

namespace quanta::quant {

/** FSQ settings; names and defaults are the reference's. */
struct FSQOptions {
  /** Levels per code dimension (each >= 2; a level of 2 needs preserve_symmetry). */
  std::vector<int64_t> levels;
  /** Input features; 0 = len(levels) * num_codebooks (no projections). */
  int64_t dim = 0;
  /** Independent codes per token; the projected features split into this many. */
  int64_t num_codebooks = 1;
  /** Keep a trailing codebook dim in the indices; default num_codebooks > 1. */
  std::optional<bool> keep_num_codebooks_dim;
  /** Inputs of rank 3 are [B, D, N] (rank >= 4 inputs are always channel first). */
  bool channel_first = false;
  /** Bias in project_in / project_out. */
  bool projection_has_bias = true;
  /** Symmetric grid 2/(L-1) * floor((L-1)(tanh(z)+1)/2 + 1/2) - 1 (arXiv 2411.19842). */
  bool preserve_symmetry = false;
  /** Training only: the probability that an element's code gets U(-1/2, 1/2) noise
   * added (then clamped to [-1, 1]); needs preserve_symmetry. */
  double noise_dropout = 0.0;
  /** Bound with clamp(z, -1, 1) instead of tanh (no shift). */
  bool bound_hard_clamp = false;
  /** Rotate each codebook's vector by a fixed random orthogonal matrix R before
   * quantizing (z R) and back after (codes R^T). */
  bool orthogonal_rotation = false;
};

/** Finite scalar quantizer. forward returns no auxiliary loss (loss = 0). */
class FSQ : public SingleLayerQuantizer, public StepKeyed {
 public:
  /** Builds the layer seeded with the next 64 bits of `gen` (draw_seed), as
   * every quantizer family is: that seed keys the projections'
   * initialisation, the rotation and the noise stream. */
  FSQ(FSQOptions opts, Generator& gen);
  /** Keys the noise-dropout stream by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { noise_gen_.pin(step); }

  /** Quantizes x ([B, D], [B, N, D], [B, D, N] with channel_first, or
   * [B, D, H, W...]). `mask` ([B, N] or the spatial shape, bool) is accepted
   * for a uniform quantizer interface: FSQ tokens are quantized
   * independently, so it changes nothing. Indices are int32 (int64 when the
   * codebook has more than 2^31 - 1 codes). `opts` changes nothing. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  /** forward(x, mask, {}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  /** forward(x, no mask).quantized. */
  Tensor forward(const Tensor& x) override;

  /** Bounds and rounds z [..., d] to the level grid with a straight-through
   * gradient; values in [-1, 1]. */
  Tensor quantize(const Tensor& z) const;
  /** Codes [..., d] on the grid to indices [...] (int64), exact integer basis. */
  Tensor codes_to_indices(const Tensor& codes) const;
  /** Indices [...] to per-dimension levels [..., d] in [0, L_i) (int32). */
  Tensor indices_to_level_indices(const Tensor& indices) const;
  /** Indices (as forward returns them) to codes: [..., num_codebooks * d],
   * then project_out when `project_out` and the layer has projections; image
   * or channel-first layouts get features at dim 1, as forward's output. */
  Tensor indices_to_codes(const Tensor& indices, bool project_out = true) const;
  /** Indices to codes [..., num_codebooks * d], channel-last, before
   * project_out (the rotation undone when there is one). */
  Tensor indices_to_grid_codes(const Tensor& indices) const;
  /** indices_to_grid_codes. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** What forward outputs for `indices`, channel-last: the grid codes then
   * project_out, [..., dim]. */
  Tensor get_output_from_indices(const Tensor& indices) override;
  /** The code of every index: [codebook_size, d] (f32). */
  Tensor implicit_codebook() const;

  /** prod(levels). */
  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return opts_.num_codebooks; }
  /** len(levels). */
  int64_t codebook_dim() const { return static_cast<int64_t>(opts_.levels.size()); }
  int64_t dim() const { return dim_; }
  bool has_projections() const { return project_in_ != nullptr; }
  bool keep_num_codebooks_dim() const { return keep_codebook_dim_; }
  const FSQOptions& options() const { return opts_; }
  /** The index basis cumprod([1, L_0, L_1, ...]) as integers. */
  const std::vector<int64_t>& basis() const { return basis_; }

 private:
  Tensor per_dim(const std::vector<double>& v, const Tensor& like) const;
  /** Codes [..., C, d] -> [..., C*d] -> project_out when asked. */
  Tensor codes_out(const Tensor& codes, bool project_out) const;

  FSQOptions opts_;
  uint64_t seed_;
  int64_t dim_ = 0, codebook_size_ = 1;
  bool keep_codebook_dim_ = false;
  std::vector<int64_t> basis_;
  std::shared_ptr<Linear> project_in_, project_out_;
  Tensor rotation_;  // [d, d] when orthogonal_rotation
  StepStream noise_gen_;
};

}  // namespace quanta::quant
