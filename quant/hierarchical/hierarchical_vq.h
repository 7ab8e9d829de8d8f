#pragma once
// HierarchicalVQ (vector-quantize-pytorch 1.32; VAR's multi-scale residual
// quantization): level by level, the residual is average-pooled to the
// level's spatial shape, quantized by a VectorQuantize (one shared codebook
// or one per level), resized back to the full shape by linear interpolation,
// passed through Phi (x + quant_resi (conv(x) - x), a 3-tap convolution of
// the spatial dims) and subtracted from the residual. Composed of engine ops
// only: pooling and interpolation are the matrices of
// quant/hierarchical/resample.h, Phi is conv2d.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/hierarchical/resample.h"
#include "quant/quantize_output.h"
#include "quant/step_stream.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {

/** HierarchicalVQ options (the reference's names and defaults). */
struct HierarchicalVQOptions {
  /** VectorQuantizeOptions with the defaults the reference's HierarchicalVQ
   * passes its levels. */
  static VectorQuantizeOptions default_layer_options() {
    VectorQuantizeOptions o;
    o.decay = 0.99;
    o.rotation_trick = false;
    o.kmeans_init = true;
    o.threshold_ema_dead_code = 2;
    o.sample_codebook_temp = 0.1;
    o.orthogonal_reg_max_codes = 128;
    return o;
  }

  /** Feature size of the input (required). */
  int64_t dim = 0;
  /** One codebook size for every level, or one per level (required). */
  std::vector<int64_t> codebook_size;
  /** Per level, coarse to fine: one size for every spatial dim, or one per
   * dim; non-decreasing in every dim (required). */
  std::vector<std::vector<int64_t>> scales;
  /** One VectorQuantize ("vq") for all levels; else one per level ("vqs.<i>"). */
  bool shared_codebook = true;
  /** Input [B, C, s...]; false: [B, s..., C]. */
  bool channel_first = true;
  /** The levels' VectorQuantize options with the reference HierarchicalVQ's
   * defaults (default_layer_options: decay 0.99, no rotation trick, k-means
   * init, dead-code threshold 2, sample_codebook_temp 0.1,
   * orthogonal_reg_max_codes 128); the stack
   * sets their dim, codebook_size and token layout. */
  VectorQuantizeOptions layer = default_layer_options();
  /** Phi's mix of its convolution into the upsampled codes (|quant_resi|;
   * below 1e-8 Phi is the identity). */
  double quant_resi = 0.5;
  /** 1: one Phi ("phi_shared"); n > 1: min(n, levels) of them ("phi_levels.<i>"),
   * level l using the one nearest its relative depth; <= 0: one per level. */
  int64_t share_quant_resi = 1;
  /** In training, with this probability keep only levels 0..cutoff, cutoff
   * uniform in [nested_dropout_min_levels - 1, levels - 2]. */
  double nested_dropout = 0;
  int64_t nested_dropout_min_levels = 1;
  /** Spatial dims: 1 (sequences), 2 (accept_image_fmap) or 3 (accept_3d_fmap). */
  bool accept_image_fmap = false;
  bool accept_3d_fmap = false;
};

class HierarchicalVQ : public Module, public StepKeyed {
 public:
  /** Checks the options as the reference asserts (std::invalid_argument
   * naming the option); then the VectorQuantize layers and the Phi
   * convolutions (PyTorch's default init) are drawn from `gen`. */
  HierarchicalVQ(HierarchicalVQOptions opts, Generator& gen);

  /** Quantizes `x` ([B, dim, s...] or channel-last [B, s..., dim]) where the
   * bool `mask` [B, s...] is set (undefined: everywhere). quantized: the
   * reconstruction, zero at masked positions; indices: every level's indices
   * (row-major over the level's shape, -1 where masked) concatenated along
   * one token axis, [B, sum of level sizes] (the reference returns a tuple;
   * level_offsets() splits them); loss: the commitment losses' mean over the
   * kept levels (a scalar). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor());
  /** forward() of 1-D sequences with valid lengths `lens` [B] (integers):
   * token i of sequence b is kept where i < lens[b] (the reference's `lens`). */
  QuantizeOutput forward_lens(const Tensor& x, const Tensor& lens);

  /** The reconstruction from `indices` [B, sum of level sizes] (forward's
   * layout), at spatial shape `full_shape` (empty: the last level's),
   * channel-last [B, s..., dim] when channel_first is off. */
  Tensor get_output_from_indices(const Tensor& indices, std::vector<int64_t> full_shape = {});

  /** Where each level's indices start in forward's token axis, and the total
   * at the end: num_levels() + 1 entries. */
  std::vector<int64_t> level_offsets() const;
  /** Forward's indices [B, total] as one [B, level shape...] tensor per level. */
  std::vector<Tensor> split_indices(const Tensor& indices) const;

  int64_t num_levels() const { return static_cast<int64_t>(level_shapes_.size()); }
  int64_t spatial_dims() const { return spatial_dims_; }
  const std::vector<std::vector<int64_t>>& level_shapes() const { return level_shapes_; }
  const HierarchicalVQOptions& options() const { return opts_; }
  /** The VectorQuantize of `level` (the shared one for every level). */
  VectorQuantize& vq(int64_t level);

  /** Applies every codebook's pending statistics (with update_in_forward
   * off; on, the default, each level's VectorQuantize applies its own at the
   * end of its training forward, so a shared codebook's later levels see the
   * earlier levels' update, as in the reference). */
  void update_state();
  /** Turns update_in_forward on or off for every VectorQuantize. */
  void set_update_in_forward(bool on);

  /** Keys the nested-dropout stream by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { cutoff_stream_.pin(step); }
  /** Nested dropout's draw when it applies: the last kept level, or -1 to
   * keep all. By default from the layer's stream ("hvq.nested_dropout");
   * replace it to replay another draw (the parity runner does). */
  std::function<int64_t()> draw_cutoff;
  /** The cutoff of the last forward (-1: every level kept). */
  int64_t last_cutoff() const { return last_cutoff_; }

 private:
  Tensor pool_residual(const Tensor& t, const std::vector<int64_t>& shape, const Tensor& maskf,
                       Tensor* level_mask) const;
  Tensor upsample_to_full(const Tensor& q, const std::vector<int64_t>& full, int64_t level);
  Module* choose_phi(int64_t level);
  Tensor phi(Module& p, const Tensor& x) const;
  int64_t nested_cutoff();

  HierarchicalVQOptions opts_;
  int64_t spatial_dims_ = 1;
  std::vector<std::vector<int64_t>> level_shapes_;
  std::vector<std::shared_ptr<VectorQuantize>> vqs_;
  std::vector<Module*> phis_;
  // Pooling and interpolation matrices, uploaded once per shape and device.
  mutable ResampleMatrices resample_;
  StepStream cutoff_stream_;
  int64_t last_cutoff_ = -1;
};

}  // namespace quanta::quant
