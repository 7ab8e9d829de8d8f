#pragma once
// The scalar family's options by the reference's keywords
// (quant/option_fields.h).
#include <string_view>

#include "quant/option_fields.h"
#include "quant/scalar/fsp.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/latent_quantize.h"
#include "quant/scalar/lfq.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"

namespace quanta::quant {

template <class Visit>
void for_each_option(FSQOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("levels", o.levels, K::size);
  visit("dim", o.dim, K::size);
  visit("num_codebooks", o.num_codebooks, K::size);
  visit("keep_num_codebooks_dim", o.keep_num_codebooks_dim, K::value);
  visit("channel_first", o.channel_first, K::value);
  visit("projection_has_bias", o.projection_has_bias, K::value);
  visit("preserve_symmetry", o.preserve_symmetry, K::value);
  visit("noise_dropout", o.noise_dropout, K::value);
  visit("bound_hard_clamp", o.bound_hard_clamp, K::value);
  visit("orthogonal_rotation", o.orthogonal_rotation, K::value);
}

template <class Visit>
void for_each_option(FSPOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("levels", o.levels, K::size);
  visit("dim", o.dim, K::size);
  visit("channel_first", o.channel_first, K::value);
  visit("projection_has_bias", o.projection_has_bias, K::value);
  visit("act_name", o.act_name, K::value);
  visit("quantize_rate", o.quantize_rate, K::value);
  visit("need_inv_act", o.need_inv_act, K::value);
  visit("vector_norm", o.vector_norm, K::value);
}

template <class Visit>
void for_each_option(LatentQuantizeOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("levels", o.levels, K::size);
  visit("dim", o.dim, K::size);
  visit("codebook_dim", o.codebook_dim, K::size);
  visit("commitment_loss_weight", o.commitment_loss_weight, K::value);
  visit("quantization_loss_weight", o.quantization_loss_weight, K::value);
  visit("num_codebooks", o.num_codebooks, K::size);
  visit("keep_num_codebooks_dim", o.keep_num_codebooks_dim, K::value);
  visit("optimize_values", o.optimize_values, K::value);
}

template <class Visit>
void for_each_option(LFQOptions& o, Visit&& visit) {
  using K = OptionKind;
  visit("dim", o.dim, K::size);
  visit("codebook_size", o.codebook_size, K::size);
  visit("entropy_loss_weight", o.entropy_loss_weight, K::value);
  visit("commitment_loss_weight", o.commitment_loss_weight, K::value);
  visit("diversity_gamma", o.diversity_gamma, K::value);
  visit("num_codebooks", o.num_codebooks, K::size);
  visit("keep_num_codebooks_dim", o.keep_num_codebooks_dim, K::value);
  visit("codebook_scale", o.codebook_scale, K::value);
  visit("frac_per_sample_entropy", o.frac_per_sample_entropy, K::value);
  visit("has_projections", o.has_projections, K::value);
  visit("projection_has_bias", o.projection_has_bias, K::value);
  visit("soft_clamp_input_value", o.soft_clamp_input_value, K::value);
  visit("channel_first", o.channel_first, K::value);
  visit("spherical", o.spherical, K::value);
}

/** The quantize-dropout fields every scalar stack has. */
template <class Stack, class Visit>
void for_each_stack_option(Stack& o, Visit&& visit) {
  using K = OptionKind;
  visit("num_quantizers", o.num_quantizers, K::size);
  visit("quantize_dropout", o.quantize_dropout, K::value);
  visit("quantize_dropout_cutoff_index", o.quantize_dropout_cutoff_index, K::value);
  visit("quantize_dropout_multiple_of", o.quantize_dropout_multiple_of, K::size);
}

/** ResidualFSQ: its own fields ("is_channel_first" is the reference's name
 * for the layers' channel_first here), then every FSQ option. */
template <class Visit>
void for_each_option(ResidualFSQOptions& o, Visit&& visit) {
  for_each_stack_option(o, visit);
  visit("soft_clamp_input_value", o.soft_clamp_input_value, OptionKind::value);
  visit("is_channel_first", o.fsq.channel_first, OptionKind::value);
  for_each_option(o.fsq, visit);
}

template <class Visit>
void for_each_option(ResidualLFQOptions& o, Visit&& visit) {
  for_each_stack_option(o, visit);
  for_each_option(o.lfq, visit);
}

}  // namespace quanta::quant
