#pragma once
// The VQ family's options by the reference's keywords (quant/option_fields.h).
#include <string_view>

#include "quant/option_fields.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/sim_vq.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {

template <class Visit>
void for_each_option(VectorQuantizeOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("dim", o.dim, K::size);
  visit("codebook_size", o.codebook_size, K::size);
  visit("codebook_dim", o.codebook_dim, K::size);
  visit("heads", o.heads, K::size);
  visit("separate_codebook_per_head", o.separate_codebook_per_head, K::value);
  visit("decay", o.decay, K::value);
  visit("eps", o.eps, K::value);
  visit("freeze_codebook", o.freeze_codebook, K::value);
  visit("kmeans_init", o.kmeans_init, K::value);
  visit("kmeans_iters", o.kmeans_iters, K::value);
  visit("use_cosine_sim", o.use_cosine_sim, K::value);
  visit("layernorm_after_project_in", o.layernorm_after_project_in, K::value);
  visit("threshold_ema_dead_code", o.threshold_ema_dead_code, K::value);
  visit("channel_last", o.channel_last, K::value);
  visit("accept_image_fmap", o.accept_image_fmap, K::value);
  visit("commitment_weight", o.commitment_weight, K::value);
  visit("commitment_use_cross_entropy_loss", o.commitment_use_cross_entropy_loss, K::value);
  visit("orthogonal_reg_weight", o.orthogonal_reg_weight, K::value);
  visit("orthogonal_reg_active_codes_only", o.orthogonal_reg_active_codes_only, K::value);
  visit("orthogonal_reg_max_codes", o.orthogonal_reg_max_codes, K::size);
  visit("codebook_diversity_loss_weight", o.codebook_diversity_loss_weight, K::value);
  visit("codebook_diversity_temperature", o.codebook_diversity_temperature, K::value);
  visit("stochastic_sample_codes", o.stochastic_sample_codes, K::value);
  visit("sample_codebook_temp", o.sample_codebook_temp, K::value);
  visit("straight_through", o.straight_through, K::value);
  visit("rotation_trick", o.rotation_trick, K::value);
  visit("directional_reparam", o.directional_reparam, K::value);
  visit("directional_reparam_variance", o.directional_reparam_variance, K::value);
  visit("route_gradients_to_input", o.route_gradients_to_input, K::value);
  visit("return_zeros_for_masked_padding", o.return_zeros_for_masked_padding, K::value);
  visit("learnable_codebook", o.learnable_codebook, K::value);
  visit("ema_update", o.ema_update, K::value);
  visit("manual_ema_update", o.manual_ema_update, K::value);
  visit("affine_param", o.affine_param, K::value);
  visit("affine_param_batch_decay", o.affine_param_batch_decay, K::value);
  visit("affine_param_codebook_decay", o.affine_param_codebook_decay, K::value);
  visit("sync_update_v", o.sync_update_v, K::value);
}

/** ResidualVQ: its own fields ("codebook_size": one size for every layer or
 * one per layer), then every layer option it does not set per layer. */
template <class Visit>
void for_each_option(ResidualVQOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("dim", o.dim, K::size);
  visit("num_quantizers", o.num_quantizers, K::size);
  visit("codebook_size", o.codebook_sizes, K::size);
  visit("codebook_dim", o.codebook_dim, K::size);
  visit("shared_codebook", o.shared_codebook, K::value);
  visit("quantize_dropout", o.quantize_dropout, K::value);
  visit("quantize_dropout_cutoff_index", o.quantize_dropout_cutoff_index, K::value);
  visit("quantize_dropout_multiple_of", o.quantize_dropout_multiple_of, K::size);
  visit("diveq", o.diveq, K::value);
  visit("quant_grad_frac", o.quant_grad_frac, K::value);
  visit("beam_size", o.beam_size, K::size);
  visit("eval_beam_size", o.eval_beam_size, K::size);
  visit("beam_score_quantizer_weights", o.beam_score_quantizer_weights, K::value);
  visit("implicit_neural_codebook", o.implicit_neural_codebook, K::value);
  // The reference's mlp_kwargs dict, flattened: mlp_kwargs={"depth": 2} is mlp_depth.
  visit("mlp_dim_hidden", o.mlp_dim_hidden, K::size);
  visit("mlp_depth", o.mlp_depth, K::value);
  visit("accept_image_fmap", o.accept_image_fmap, K::value);
  visit("channel_last", o.channel_last, K::value);
  for_each_option(o.layer, [&](std::string_view name, auto& field, OptionKind kind) {
    for (std::string_view own :
         {"dim", "codebook_size", "codebook_dim", "accept_image_fmap", "channel_last"})
      if (name == own) return;
    visit(name, field, kind);
  });
}

/** GroupedResidualVQ: dim, groups and the layout, then each group's stack's. */
template <class Visit>
void for_each_option(GroupedResidualVQOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("dim", o.dim, K::size);
  visit("groups", o.groups, K::size);
  visit("accept_image_fmap", o.accept_image_fmap, K::value);
  visit("channel_last", o.channel_last, K::value);
  for_each_option(o.rvq, [&](std::string_view name, auto& field, OptionKind kind) {
    for (std::string_view own : {"dim", "accept_image_fmap", "channel_last"})
      if (name == own) return;
    visit(name, field, kind);
  });
}

template <class Visit>
void for_each_option(SimVQOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("dim", o.dim, K::size);
  visit("codebook_size", o.codebook_size, K::size);
  visit("frozen_codebook_dim", o.frozen_codebook_dim, K::size);
  visit("channel_first", o.channel_first, K::value);
  visit("rotation_trick", o.rotation_trick, K::value);
  visit("input_to_quantize_commit_loss_weight", o.input_to_quantize_commit_loss_weight, K::value);
  visit("commitment_weight", o.commitment_weight, K::value);
}

}  // namespace quanta::quant
