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
#include "engine/random/sampling.h"
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

ResidualSimVQ::ResidualSimVQ(const ResidualSimVQOptions& opts, Generator& gen)
    : Residual("ResidualSimVQ", {opts.quantize_dropout, opts.quantize_dropout_cutoff_index,
                                 opts.quantize_dropout_multiple_of}),
      opts_(opts) {
  if (opts_.num_quantizers <= 0) sim_vq_fail("ResidualSimVQ", "num_quantizers must be positive");
  quantize_dropout().check("ResidualSimVQ", opts_.num_quantizers);
  auto list = std::make_shared<Module>("ModuleList");
  register_module("layers", list);
  for (int64_t i = 0; i < opts_.num_quantizers; ++i) {
    SimVQOptions lo = opts_.layer;
    lo.dim = opts_.dim;
    lo.codebook_size = opts_.codebook_size;
    lo.rotation_trick = opts_.rotation_trick;
    lo.channel_first = false;  // the stack works on channel-last tokens
    auto l = std::make_shared<SimVQ>(lo, gen);
    list->register_module(std::to_string(i), l);
    layers_.push_back(l);
  }
  seed_dropout(named_stream(draw_seed(gen), "rvq.dropout"));
}

QuantizeOutput ResidualSimVQ::forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                                           const QuantizeOptions&) {
  const TokenLayout layout(x, !opts_.accept_image_fmap, opts_.dim, "ResidualSimVQ");
  const Tensor token_mask = detail::token_mask(mask, layout, "ResidualSimVQ");
  return quantize_tokens(layout, x, nullptr, nullptr, [&](const Tensor& z) {
    return residual_quantize(z, num_quantizers(), last_kept, DType::i64, MemberLosses::stacked,
                             [&](int64_t i, const Tensor& residual) {
                               return layers_[static_cast<size_t>(i)]->forward(residual,
                                                                               token_mask);
                             });
  });
}

Tensor ResidualSimVQ::get_codes_from_indices(const Tensor& indices) {
  return residual_codes(
      indices, num_quantizers(),
      [&](int64_t i, const Tensor& idx) {
        return embedding(layers_[static_cast<size_t>(i)]->codebook(), idx);
      },
      "ResidualSimVQ");
}

Tensor ResidualSimVQ::get_output_from_indices(const Tensor& indices) {
  return sum(get_codes_from_indices(indices), {0});
}

}  // namespace quanta::quant
