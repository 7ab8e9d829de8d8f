#include "quant/vq/residual_vq.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "engine/factory.h"
#include "quant/residual_of_impl.h"
#include "quant/vq/directional_reparam.h"
#include "quant/vq/residual_beam_search.h"

namespace quanta::quant {
namespace {

[[noreturn]] void residual_vq_fail(const std::string& what) {
  throw std::invalid_argument("[ResidualVQ] " + what);
}

}  // namespace

StackPlan LayerTraits<VectorQuantize>::plan(Options& o) {
  if (o.dim <= 0) residual_vq_fail("dim must be positive, got " + std::to_string(o.dim));
  if (o.num_quantizers <= 0) o.num_quantizers = static_cast<int64_t>(o.codebook_sizes.size());
  if (o.num_quantizers <= 0) residual_vq_fail("num_quantizers must be positive");
  if (o.codebook_sizes.size() == 1)
    o.codebook_sizes.assign(static_cast<size_t>(o.num_quantizers), o.codebook_sizes[0]);
  if (static_cast<int64_t>(o.codebook_sizes.size()) != o.num_quantizers)
    residual_vq_fail("codebook_sizes has " + std::to_string(o.codebook_sizes.size()) +
                     " entries for " + std::to_string(o.num_quantizers) + " quantizers");
  if (o.layer.heads != 1) residual_vq_fail("heads must be 1 (the reference asserts it)");
  if (!(o.quant_grad_frac >= 0 && o.quant_grad_frac <= 1))
    residual_vq_fail("quant_grad_frac must be in [0, 1], got " + std::to_string(o.quant_grad_frac));
  if (o.beam_size < 0)
    residual_vq_fail("beam_size must be >= 0, got " + std::to_string(o.beam_size));
  if (o.eval_beam_size && *o.eval_beam_size < 1)
    residual_vq_fail("eval_beam_size must be >= 1, got " + std::to_string(*o.eval_beam_size));
  if (o.eval_beam_size && o.beam_size == 0)
    residual_vq_fail("eval_beam_size needs beam_size (the reference asserts it)");
  if (!o.beam_score_quantizer_weights.empty() &&
      static_cast<int64_t>(o.beam_score_quantizer_weights.size()) != o.num_quantizers)
    residual_vq_fail("beam_score_quantizer_weights has " +
                     std::to_string(o.beam_score_quantizer_weights.size()) + " weights for " +
                     std::to_string(o.num_quantizers) + " quantizers");
  if (o.diveq && o.layer.ema_update.value_or(false))
    residual_vq_fail("diveq trains the codes by gradient: ema_update must be off");
  if (o.diveq && !o.layer.learnable_codebook.value_or(true))
    residual_vq_fail("diveq trains the codes by gradient: learnable_codebook must be on");
  if (o.diveq && o.layer.directional_reparam)
    residual_vq_fail(
        "diveq reparameterises the stack's output: its layers take no "
        "directional_reparam");
  if (o.implicit_neural_codebook) {
    if (o.beam_size > 1 || o.eval_beam_size.value_or(1) > 1)
      residual_vq_fail("implicit_neural_codebook does not take beam search (beam_size)");
    if (o.layer.use_cosine_sim || o.layer.affine_param)
      residual_vq_fail(
          "implicit_neural_codebook trains the codes by gradient: use_cosine_sim and "
          "affine_param must be off");
    if (o.layer.ema_update.value_or(false) || !o.layer.learnable_codebook.value_or(true))
      residual_vq_fail(
          "implicit_neural_codebook trains the codes by gradient: ema_update must be off and "
          "learnable_codebook on");
    if (o.mlp_dim_hidden < 0 || o.mlp_depth < 0)
      residual_vq_fail("mlp_kwargs dim_hidden and depth must be >= 0");
  }
  if (o.shared_codebook)
    for (int64_t s : o.codebook_sizes)
      if (s != o.codebook_sizes[0])
        residual_vq_fail("shared_codebook needs one codebook size for all layers");
  return {.dim = o.dim,
          .layer_dim = o.codebook_dim > 0 ? o.codebook_dim : o.dim,
          .num_quantizers = o.num_quantizers,
          .channel_last = o.channel_last,
          .accept_image_fmap = o.accept_image_fmap,
          .projection_bias = true,
          .dropout = {o.quantize_dropout, o.quantize_dropout_cutoff_index,
                      o.quantize_dropout_multiple_of}};
}

std::shared_ptr<VectorQuantize> LayerTraits<VectorQuantize>::make_layer(
    const Options& opts, const StackPlan& plan, int64_t i,
    const std::vector<std::shared_ptr<VectorQuantize>>& built, Generator& gen) {
  VectorQuantizeOptions lo = opts.layer;
  lo.dim = plan.layer_dim;
  lo.codebook_dim = plan.layer_dim;
  lo.codebook_size = opts.codebook_sizes[static_cast<size_t>(i)];
  lo.channel_last = true;
  lo.accept_image_fmap = false;
  lo.update_in_forward = opts.update_in_forward && !opts.shared_codebook;
  // A shared codebook's codes follow its statistics once per forward, after
  // the last layer, whatever the layers ask (as the reference forces).
  if (opts.shared_codebook) lo.manual_ema_update = false;
  if (opts.implicit_neural_codebook) {
    lo.ema_update = false;
    lo.learnable_codebook = true;
  }
  if (opts.diveq) {
    lo.ema_update = false;
    lo.learnable_codebook = true;
    lo.route_gradients_to_input = false;
    lo.commitment_weight = 0;
  }
  if (opts.shared_codebook && i > 0)
    return std::make_shared<VectorQuantize>(lo, gen, built[0]->codebook_ptr());
  auto layer = std::make_shared<VectorQuantize>(lo, gen);
  // Every level calls a shared codebook once per forward.
  if (opts.shared_codebook) layer->codebook().set_calls_per_forward(opts.num_quantizers);
  return layer;
}

QuantizeOutput LayerTraits<VectorQuantize>::quantize(VectorQuantize& layer, const Tensor& residual,
                                                     const Tensor& token_mask,
                                                     const QuantizeOptions& opts) {
  return layer.forward(residual, token_mask, opts);  // it reads the condition only
}

Tensor LayerTraits<VectorQuantize>::codes(VectorQuantize& layer, const Tensor& indices,
                                          const Tensor& condition) {
  return layer.codes_from_indices(indices, condition);
}

void LayerTraits<VectorQuantize>::after_forward(
    const Options& opts, bool training,
    const std::vector<std::shared_ptr<VectorQuantize>>& layers) {
  if (opts.shared_codebook && opts.update_in_forward && training) layers[0]->update_state();
}

std::optional<QuantizeOutput> LayerTraits<VectorQuantize>::search(
    const Options& opts, bool training, const std::vector<std::shared_ptr<VectorQuantize>>& layers,
    const Tensor& tokens, const Tensor& keep, int64_t last_kept) {
  const int64_t beam = training ? opts.beam_size : opts.eval_beam_size.value_or(opts.beam_size);
  if (beam <= 1) return std::nullopt;
  BeamSearch s;
  s.beam = beam;
  s.weights = opts.beam_score_quantizer_weights;
  if (s.weights.empty()) s.weights.assign(layers.size(), 1.0);
  s.grad_frac = quant_grad_frac(opts);
  return residual_beam_search(tokens, keep, layers, last_kept, s, training);
}

void LayerTraits<VectorQuantize>::route_output(
    const Options& opts, bool training, const std::vector<std::shared_ptr<VectorQuantize>>& layers,
    const Tensor& tokens, QuantizeOutput& out) {
  if (!opts.diveq || !training) return;
  out.quantized =
      directional_reparam(tokens, out.quantized, opts.layer.directional_reparam_variance,
                          layers[0]->directional_noise(tokens.shape(), options_of(tokens)));
}

GroupedLayout LayerTraits<VectorQuantize>::grouped_layout(const GroupedOptions& opts) {
  return {.dim = opts.dim,
          .groups = opts.groups,
          .channel_last = opts.channel_last,
          .accept_image_fmap = opts.accept_image_fmap};
}

ResidualVQOptions LayerTraits<VectorQuantize>::group_options(const GroupedOptions& opts) {
  ResidualVQOptions o = opts.rvq;
  o.dim = opts.dim / opts.groups;
  o.channel_last = true;
  o.accept_image_fmap = false;
  return o;
}

template class ResidualOf<VectorQuantize>;
template class GroupedOf<VectorQuantize, ResidualVQ>;

ResidualVQ::ResidualVQ(ResidualVQOptions opts, Generator& gen) : ResidualOf(std::move(opts), gen) {
  if (!options().implicit_neural_codebook) return;
  auto list = register_module("mlps", std::make_shared<Module>("ModuleList"));
  for (int64_t i = 1; i < num_quantizers(); ++i) {
    auto mlp = list->register_module(
        std::to_string(i - 1),
        std::make_shared<ImplicitCodebookMLP>(layer(i).codebook_dim(), options().mlp_dim_hidden,
                                              options().mlp_depth, gen));
    // After the layer's own transform (a vq_bridge), as the reference orders them.
    VectorQuantize& l = layer(i);
    l.codebook_transform = [mlp, before = l.codebook_transform](const Tensor& codes,
                                                                const Tensor& condition) {
      return mlp->forward(before ? before(codes, condition) : codes, condition);
    };
  }
}

void ResidualVQ::update_state() {
  if (options().shared_codebook) {
    layer(0).update_state();
    return;
  }
  for (int64_t i = 0; i < num_quantizers(); ++i) layer(i).update_state();
}

void ResidualVQ::update_ema() {
  for (int64_t i = 0; i < (options().shared_codebook ? 1 : num_quantizers()); ++i)
    layer(i).update_ema();
}

void ResidualVQ::set_update_in_forward(bool on) {
  mutable_options().update_in_forward = on;
  for (int64_t i = 0; i < num_quantizers(); ++i)
    layer(i).set_update_in_forward(on && !options().shared_codebook);
}

void GroupedResidualVQ::update_state() {
  for (int64_t g = 0; g < groups(); ++g) group(g).update_state();
}

void GroupedResidualVQ::set_update_in_forward(bool on) {
  for (int64_t g = 0; g < groups(); ++g) group(g).set_update_in_forward(on);
}

}  // namespace quanta::quant
