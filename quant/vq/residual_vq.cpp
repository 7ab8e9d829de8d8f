#include "quant/vq/residual_vq.h"

#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "quant/streams.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void residual_vq_fail(const char* who, const std::string& what) {
  throw std::invalid_argument(std::string("[") + who + "] " + what);
}

QuantizeDropout dropout_of(const ResidualVQOptions& o) {
  return {o.quantize_dropout, o.quantize_dropout_cutoff_index, o.quantize_dropout_multiple_of};
}

ResidualVQOptions checked(ResidualVQOptions o) {
  const char* who = "ResidualVQ";
  if (o.dim <= 0) residual_vq_fail(who, "dim must be positive, got " + std::to_string(o.dim));
  if (o.num_quantizers <= 0) o.num_quantizers = static_cast<int64_t>(o.codebook_sizes.size());
  if (o.num_quantizers <= 0) residual_vq_fail(who, "num_quantizers must be positive");
  if (o.codebook_sizes.size() == 1)
    o.codebook_sizes.assign(static_cast<size_t>(o.num_quantizers), o.codebook_sizes[0]);
  if (static_cast<int64_t>(o.codebook_sizes.size()) != o.num_quantizers)
    residual_vq_fail(who, "codebook_sizes has " + std::to_string(o.codebook_sizes.size()) +
                              " entries for " + std::to_string(o.num_quantizers) + " quantizers");
  if (o.layer.heads != 1) residual_vq_fail(who, "heads must be 1 (the reference asserts it)");
  if (o.shared_codebook)
    for (int64_t s : o.codebook_sizes)
      if (s != o.codebook_sizes[0])
        residual_vq_fail(who, "shared_codebook needs one codebook size for all layers");
  dropout_of(o).check(who, o.num_quantizers);
  return o;
}

}  // namespace

ResidualVQ::ResidualVQ(const ResidualVQOptions& opts, Generator& gen)
    : ResidualVQ(checked(opts), gen, Validated{}) {}

ResidualVQ::ResidualVQ(const ResidualVQOptions& opts, Generator& gen, Validated)
    : Residual("ResidualVQ", dropout_of(opts)), opts_(opts) {
  codebook_dim_ = opts_.codebook_dim > 0 ? opts_.codebook_dim : opts_.dim;
  if (codebook_dim_ != opts_.dim) {
    project_in_ = register_module("project_in", std::shared_ptr<Module>(std::make_shared<Linear>(
                                                    opts_.dim, codebook_dim_, gen)));
    project_out_ = register_module("project_out", std::shared_ptr<Module>(std::make_shared<Linear>(
                                                      codebook_dim_, opts_.dim, gen)));
  }
  auto layers = std::make_shared<Module>("ModuleList");
  register_module("layers", layers);
  for (int64_t i = 0; i < opts_.num_quantizers; ++i) {
    VectorQuantizeOptions lo = opts_.layer;
    lo.dim = codebook_dim_;
    lo.codebook_dim = codebook_dim_;
    lo.codebook_size = opts_.codebook_sizes[static_cast<size_t>(i)];
    lo.channel_last = true;
    lo.accept_image_fmap = false;
    // A shared codebook is updated once, after all layers (the reference's
    // manual_ema_update): the layers only accumulate.
    lo.update_in_forward = opts_.update_in_forward && !opts_.shared_codebook;
    auto layer = (opts_.shared_codebook && i > 0)
                     ? std::make_shared<VectorQuantize>(lo, gen, layers_[0]->codebook_ptr())
                     : std::make_shared<VectorQuantize>(lo, gen);
    layers->register_module(std::to_string(i), layer);
    layers_.push_back(layer);
  }
  seed_dropout(named_stream(draw_seed(gen), "rvq.dropout"));
}

QuantizeOutput ResidualVQ::forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                                        const QuantizeOptions&) {
  if (x.dim() >= 4 && !opts_.accept_image_fmap)
    residual_vq_fail("ResidualVQ",
                     "got a feature map of shape " + shape_str(x.shape()) +
                         "; set accept_image_fmap to quantize [B, D, H, W...] inputs");
  const TokenLayout layout(x, opts_.channel_last, opts_.dim, "ResidualVQ");
  const Tensor token_mask = detail::token_mask(mask, layout, "ResidualVQ");
  return quantize_tokens(layout, x, project_in_.get(), project_out_.get(), [&](const Tensor& z) {
    QuantizeOutput out =
        residual_quantize(z, num_quantizers(), last_kept, DType::i64, MemberLosses::stacked,
                          [&](int64_t i, const Tensor& residual) {
                            return layers_[static_cast<size_t>(i)]->forward(residual, token_mask);
                          });
    if (opts_.shared_codebook && opts_.update_in_forward && is_training())
      layers_[0]->update_state();
    return out;
  });
}

Tensor ResidualVQ::get_codes_from_indices(const Tensor& indices) {
  return residual_codes(
      indices, num_quantizers(),
      [&](int64_t i, const Tensor& idx) {
        return layers_[static_cast<size_t>(i)]->get_codes_from_indices(idx);
      },
      "ResidualVQ");
}

Tensor ResidualVQ::get_output_from_indices(const Tensor& indices) {
  const Tensor summed = sum(get_codes_from_indices(indices), {0});
  return project_in_ ? project_out_->forward(summed) : summed;
}

void ResidualVQ::update_state() {
  if (opts_.shared_codebook) {
    layers_[0]->update_state();
    return;
  }
  for (auto& l : layers_) l->update_state();
}

void ResidualVQ::set_update_in_forward(bool on) {
  opts_.update_in_forward = on;
  for (auto& l : layers_) l->set_update_in_forward(on && !opts_.shared_codebook);
}

GroupedResidualVQ::GroupedResidualVQ(const GroupedResidualVQOptions& opts, Generator& gen)
    : Grouped("GroupedResidualVQ", {.dim = opts.dim,
                                    .groups = opts.groups,
                                    .channel_last = opts.channel_last,
                                    .accept_image_fmap = opts.accept_image_fmap,
                                    .losses = MemberLosses::stacked}) {
  for (int64_t g = 0; g < opts.groups; ++g) {
    ResidualVQOptions ro = opts.rvq;
    ro.dim = opts.dim / opts.groups;
    ro.channel_last = true;
    ro.accept_image_fmap = false;
    add_group(std::make_shared<ResidualVQ>(ro, gen));
  }
}

void GroupedResidualVQ::update_state() {
  for (int64_t g = 0; g < groups(); ++g) group(g).update_state();
}

void GroupedResidualVQ::set_update_in_forward(bool on) {
  for (int64_t g = 0; g < groups(); ++g) group(g).set_update_in_forward(on);
}

}  // namespace quanta::quant
