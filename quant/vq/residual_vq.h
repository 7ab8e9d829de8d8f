#pragma once
// ResidualVQ: a stack of VectorQuantize layers, each quantizing what the
// previous ones left (SoundStream), with optional quantizer dropout; and
// GroupedResidualVQ, one ResidualVQ per slice of the feature dimension. Both
// are made from LayerTraits<VectorQuantize> (quant/layer_traits.h).
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/grouped_of.h"
#include "quant/layer_traits.h"
#include "quant/quantize_output.h"
#include "quant/residual.h"
#include "quant/residual_of.h"
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
  /** DiVeQ across the stack: the layers' codes learn by gradient (no EMA, no
   * commitment loss, their outputs are their codes), the residual passes
   * every gradient back (quant_grad_frac 1), and in training the summed
   * output is directionally reparameterised against the stack's input
   * (quant/vq/directional_reparam.h; noise variance
   * layer.directional_reparam_variance, drawn from layer 0's stream). */
  bool diveq = false;
  /** The fraction of later layers' gradient that reaches a layer's output
   * through the residual (0: none, the SoundStream default; 1: all). */
  double quant_grad_frac = 0;
  /** Beam search (quant/vq/residual_beam_search.h) with this many paths per
   * token in training; 0 or 1: greedy, layer by layer. */
  int64_t beam_size = 0;
  /** Paths in eval (unset: beam_size). */
  std::optional<int64_t> eval_beam_size;
  /** Layer i's commitment counts this many times in a path's score (empty:
   * 1 for every layer; else one per layer). */
  std::vector<double> beam_score_quantizer_weights;
  /** QINCo's implicit neural codebook: layer i > 0 quantizes with a codebook
   * of its own for every token, its codes passed with the token's running
   * sum of the earlier layers' outputs through an ImplicitCodebookMLP
   * (quant/vq/codebook_transform.h; modules "mlps.<i-1>", drawn from the
   * generator last, after the dropout stream's seed). The layers' codes learn by gradient (no EMA).
   * Not with beam search, cosine similarity or affine_param. */
  bool implicit_neural_codebook = false;
  /** The MLPs' hidden width (0: the layer dimension) and number of residual
   * blocks (the reference's mlp_kwargs dim_hidden and depth; options
   * "mlp_dim_hidden" and "mlp_depth"). */
  int64_t mlp_dim_hidden = 0;
  int64_t mlp_depth = 4;
  /** Apply every codebook's statistics at the end of a training forward. */
  bool update_in_forward = true;
  /** Every other VectorQuantize option, for all layers (dim, codebook_size,
   * codebook_dim and update_in_forward are set per layer). */
  VectorQuantizeOptions layer;
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

/** How a stack of VectorQuantize layers is made (quant/layer_traits.h). */
template <>
struct LayerTraits<VectorQuantize> {
  using Options = ResidualVQOptions;
  using GroupedOptions = GroupedResidualVQOptions;
  static constexpr const char* name = "ResidualVQ";
  static constexpr const char* grouped_name = "GroupedResidualVQ";
  static constexpr DType index_dtype = DType::i64;
  static constexpr MemberLosses losses = MemberLosses::stacked;

  /** Fills num_quantizers from codebook_sizes and one size to every layer. */
  static StackPlan plan(Options& opts);
  /** Layer i > 0 of a shared_codebook stack quantizes with layer 0's codebook. */
  static std::shared_ptr<VectorQuantize> make_layer(
      const Options& opts, const StackPlan& plan, int64_t i,
      const std::vector<std::shared_ptr<VectorQuantize>>& built, Generator& gen);
  static QuantizeOutput quantize(VectorQuantize& layer, const Tensor& residual,
                                 const Tensor& token_mask, const QuantizeOptions& opts);
  /** `condition`: the earlier layers' codes summed (implicit neural codebook). */
  static Tensor codes(VectorQuantize& layer, const Tensor& indices,
                      const Tensor& condition = Tensor());
  /** The implicit neural codebook conditions layers on the running sum. */
  static bool conditions_layers(const Options& opts) { return opts.implicit_neural_codebook; }
  /** A shared codebook is updated once, after all layers (the reference's
   * manual_ema_update): its layers only accumulate. */
  static void after_forward(const Options& opts, bool training,
                            const std::vector<std::shared_ptr<VectorQuantize>>& layers);
  static double quant_grad_frac(const Options& opts) {
    return opts.diveq ? 1.0 : opts.quant_grad_frac;
  }
  /** The beam search instead of the greedy loop when the mode's beam size is
   * above 1; nullopt otherwise. */
  static std::optional<QuantizeOutput> search(
      const Options& opts, bool training,
      const std::vector<std::shared_ptr<VectorQuantize>>& layers, const Tensor& tokens,
      const Tensor& keep, int64_t last_kept);
  /** diveq's reparameterisation of the summed output (training only). */
  static void route_output(const Options& opts, bool training,
                           const std::vector<std::shared_ptr<VectorQuantize>>& layers,
                           const Tensor& tokens, QuantizeOutput& out);
  /** Masked tokens output zeros, or with layer.return_zeros_for_masked_padding
   * off the input, after project_out (vector-quantize-pytorch 1.32). */
  static MaskedOutput masked_output(const Options& opts, const Tensor& keep) {
    return {keep, opts.layer.return_zeros_for_masked_padding};
  }
  static GroupedLayout grouped_layout(const GroupedOptions& opts);
  static Options group_options(const GroupedOptions& opts);
};

extern template class ResidualOf<VectorQuantize>;

class ResidualVQ : public ResidualOf<VectorQuantize> {
 public:
  /** Layers "layers.<i>", projections "project_in" / "project_out", built
   * from `gen` (quant/layer_traits.h's seeding), then with
   * implicit_neural_codebook the MLPs "mlps.<i>" of layers 1.. . */
  ResidualVQ(ResidualVQOptions opts, Generator& gen);

  /** Quantizes `x` (layouts as VectorQuantize). Indices [B, N, Q] (-1 for
   * dropped layers and masked tokens), loss [Q] (0 for dropped layers), and
   * each VectorQuantize loss term stacked per layer. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }
  using ResidualOf::forward;

  /** Applies every codebook's pending statistics (each shared one once). */
  void update_state();
  /** Every codebook's codes from its EMA statistics (layer.manual_ema_update). */
  void update_ema();
  /** Turns update_in_forward on or off for the whole stack. */
  void set_update_in_forward(bool on);
};

extern template class GroupedOf<VectorQuantize, ResidualVQ>;

class GroupedResidualVQ : public GroupedOf<VectorQuantize, ResidualVQ> {
 public:
  /** Groups "rvqs.<g>", built one after another from `gen`. */
  using GroupedOf::GroupedOf;
  /** Quantized features concatenated over groups; indices [G, B, N, Q], loss
   * [G, Q], loss terms [G, Q]. One dropout decision for all groups. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }
  using GroupedOf::forward;
  void update_state();
  void set_update_in_forward(bool on);
};

}  // namespace quanta::quant
