#include "quant/vq/sim_vq.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/loss.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/residual_of_impl.h"
#include "quant/streams.h"
#include "quant/token_layout.h"
#include "quant/vq/commitment_loss.h"
#include "quant/vq/nearest_code.h"
#include "quant/vq/rotation_trick.h"

namespace quanta::quant {
namespace {

[[noreturn]] void sim_vq_fail(const char* who, const std::string& what) {
  throw std::invalid_argument(std::string("[") + who + "] " + what);
}

}  // namespace

SimVQ::SimVQ(const SimVQOptions& opts, Generator& gen)
    : SingleLayerQuantizer("SimVQ"), opts_(opts) {
  if (opts_.dim <= 0 || opts_.codebook_size <= 0)
    sim_vq_fail("SimVQ", "dim and codebook_size must be positive, got " +
                             std::to_string(opts_.dim) + " and " +
                             std::to_string(opts_.codebook_size));
  const int64_t df = opts_.frozen_codebook_dim > 0 ? opts_.frozen_codebook_dim : opts_.dim;
  transform_ = register_module("code_transform",
                               std::make_shared<Linear>(df, opts_.dim, gen, /*bias=*/false));
  frozen_ = register_buffer("frozen_codebook",
                            randn({opts_.codebook_size, df}, gen) / std::sqrt(double(df)));
}

Tensor SimVQ::codebook() { return transform_->forward(frozen_); }

QuantizeOutput SimVQ::forward(const Tensor& x, const Tensor& mask, const QuantizeOptions&) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const TokenLayout layout(x, !opts_.channel_first, opts_.dim, "SimVQ");
  const int64_t b = layout.batch(), n = layout.tokens(), d = opts_.dim;
  const Tensor tokens = reshape(layout.to_tokens(x), {b * n, d});
  Tensor valid;
  if (mask.defined()) {
    if (mask.dtype() != DType::boolean || mask.numel() != b * n)
      sim_vq_fail("SimVQ", "mask must be bool with one entry per token, got " +
                               std::string(dtype_name(mask.dtype())) + " " +
                               shape_str(mask.shape()));
    valid = reshape(mask, {b * n});
  }
  const Tensor codes = codebook();
  const Tensor idx = nearest_codes(tokens, codes, false);
  const Tensor q = index_select(codes, 0, idx);  // gradient to the transform
  // mse(sg(x), q) trains the transform, w * mse(x, sg(q)) commits the input.
  Tensor loss = zeros({}, options_of(tokens));
  if (b * n > 0)
    loss =
        (commitment_loss(tokens.detach(), q, valid) +
         commitment_loss(tokens, q.detach(), valid) * opts_.input_to_quantize_commit_loss_weight) *
        opts_.commitment_weight;
  Tensor out =
      opts_.rotation_trick ? rotate_to(tokens, q.detach()) : straight_through(tokens, q.detach());
  Tensor indices = idx;
  if (valid.defined()) {
    out = out * unsqueeze(to_dtype(valid, out.dtype()), -1);
    indices = where(valid, idx, full_like(idx, -1.0));
  }
  QuantizeOutput r;
  r.quantized = layout.from_tokens(reshape(out, {b, n, d}));
  r.indices = layout.spatial_from_tokens(reshape(indices, {b, n}));
  r.loss = loss;
  r.losses = {{"commitment", loss}};
  return r;
}

Tensor SimVQ::get_codes_from_indices(const Tensor& indices) {
  // Gathered before the transform, as indices_to_codes (the reference's).
  const Tensor idx = to_dtype(indices, DType::i64);
  const Tensor none = zeros({}, options_of(idx));
  const Tensor masked = lt(idx, none);
  const Tensor q = transform_->forward(embedding(frozen_, where(masked, none, idx)));
  return masked_fill(q, unsqueeze(masked, -1), 0.0);
}

Tensor SimVQ::get_output_from_indices(const Tensor& indices) {
  return get_codes_from_indices(indices);
}

Tensor SimVQ::indices_to_codes(const Tensor& indices) {
  Tensor q = transform_->forward(embedding(frozen_, indices));
  if (opts_.channel_first && q.dim() >= 3) {
    std::vector<int64_t> perm{0, q.dim() - 1};
    for (int64_t i = 1; i < q.dim() - 1; ++i) perm.push_back(i);
    q = permute(q, perm);
  }
  return q;
}

StackPlan LayerTraits<SimVQ>::plan(Options& opts) {
  // (num_quantizers >= 1 is ResidualOf's check.)
  // Rank >= 4 inputs are feature maps whatever accept_image_fmap says (it
  // only moves the features of sequences to dim 1).
  return {.dim = opts.dim,
          .layer_dim = opts.dim,
          .num_quantizers = opts.num_quantizers,
          .channel_last = !opts.accept_image_fmap,
          .accept_image_fmap = true,
          .dropout = {opts.quantize_dropout, opts.quantize_dropout_cutoff_index,
                      opts.quantize_dropout_multiple_of}};
}

std::shared_ptr<SimVQ> LayerTraits<SimVQ>::make_layer(const Options& opts, const StackPlan&,
                                                      int64_t,
                                                      const std::vector<std::shared_ptr<SimVQ>>&,
                                                      Generator& gen) {
  SimVQOptions lo = opts.layer;
  lo.dim = opts.dim;
  lo.codebook_size = opts.codebook_size;
  lo.rotation_trick = opts.rotation_trick;
  lo.channel_first = false;  // the stack works on channel-last tokens
  return std::make_shared<SimVQ>(lo, gen);
}

QuantizeOutput LayerTraits<SimVQ>::quantize(SimVQ& layer, const Tensor& residual,
                                            const Tensor& token_mask, const QuantizeOptions&) {
  return layer.forward(residual, token_mask);
}

Tensor LayerTraits<SimVQ>::codes(SimVQ& layer, const Tensor& indices) {
  return embedding(layer.codebook(), indices);
}

template class ResidualOf<SimVQ>;

}  // namespace quanta::quant
