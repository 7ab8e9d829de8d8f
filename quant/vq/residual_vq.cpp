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
#include "engine/random/sampling.h"
#include "quant/token_layout.h"
#include "quant/vq/streams.h"

namespace quanta::quant {
namespace {

[[noreturn]] void fail(const char* who, const std::string& what) {
  throw std::invalid_argument(std::string("[") + who + "] " + what);
}

ResidualVQOptions checked(ResidualVQOptions o) {
  const char* who = "ResidualVQ";
  if (o.dim <= 0) fail(who, "dim must be positive, got " + std::to_string(o.dim));
  if (o.num_quantizers <= 0) o.num_quantizers = static_cast<int64_t>(o.codebook_sizes.size());
  if (o.num_quantizers <= 0) fail(who, "num_quantizers must be positive");
  if (o.codebook_sizes.size() == 1)
    o.codebook_sizes.assign(static_cast<size_t>(o.num_quantizers), o.codebook_sizes[0]);
  if (static_cast<int64_t>(o.codebook_sizes.size()) != o.num_quantizers)
    fail(who, "codebook_sizes has " + std::to_string(o.codebook_sizes.size()) + " entries for " +
                  std::to_string(o.num_quantizers) + " quantizers");
  if (o.layer.heads != 1) fail(who, "heads must be 1 (the reference asserts it)");
  if (o.shared_codebook)
    for (int64_t s : o.codebook_sizes)
      if (s != o.codebook_sizes[0])
        fail(who, "shared_codebook needs one codebook size for all layers");
  if (o.quantize_dropout_cutoff_index < 0 ||
      (o.quantize_dropout && o.quantize_dropout_cutoff_index >= o.num_quantizers))
    fail(who, "quantize_dropout_cutoff_index must lie in [0, num_quantizers), got " +
                  std::to_string(o.quantize_dropout_cutoff_index));
  if (o.quantize_dropout_multiple_of < 1) fail(who, "quantize_dropout_multiple_of must be >= 1");
  return o;
}

}  // namespace

ResidualVQ::ResidualVQ(const ResidualVQOptions& opts, Generator& gen)
    : Module("ResidualVQ"), opts_(checked(opts)), dropout_gen_(Generator(0)) {
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
  dropout_gen_ = StepStream(named_stream(draw_seed(gen), "rvq.dropout"));
}

int64_t ResidualVQ::draw_last_layer() {
  const int64_t q = num_quantizers();
  int64_t k = randint(opts_.quantize_dropout_cutoff_index, q, {}, dropout_gen_.next()).item<int64_t>();
  const int64_t m = opts_.quantize_dropout_multiple_of;
  if (m != 1) k = ((k + 1 + m - 1) / m) * m - 1;
  return k;
}

QuantizeOutput ResidualVQ::forward(const Tensor& x, const Tensor& mask) {
  const bool dropout = is_training() && opts_.quantize_dropout && num_quantizers() > 1;
  return forward_with_last_layer(x, mask, dropout ? draw_last_layer() : -1);
}

QuantizeOutput ResidualVQ::forward_with_last_layer(const Tensor& x, const Tensor& mask,
                                                   int64_t last_layer) {
  if (x.dim() >= 4 && !opts_.accept_image_fmap)
    fail("ResidualVQ", "got a feature map of shape " + shape_str(x.shape()) +
                           "; set accept_image_fmap to quantize [B, D, H, W...] inputs");
  const TokenLayout layout(x, opts_.channel_last, opts_.dim, "ResidualVQ");
  const int64_t b = layout.batch(), n = layout.tokens();
  Tensor tokens = layout.to_tokens(x);
  if (project_in_) tokens = project_in_->forward(tokens);
  Tensor token_mask;
  if (mask.defined()) token_mask = reshape(mask, {b, n});
  Tensor residual = tokens;
  std::vector<Tensor> outputs;  // summed once at the end (add_n: one pass)
  std::vector<Tensor> indices, losses;
  std::vector<std::string> term_names;
  std::vector<std::vector<Tensor>> terms;
  const Tensor zero_loss = zeros({}, options_of(tokens));
  for (int64_t i = 0; i < num_quantizers(); ++i) {
    if (last_layer >= 0 && i > last_layer) {
      indices.push_back(full({b, n}, -1.0, {.dtype = DType::i64}));
      losses.push_back(zero_loss);
      for (auto& t : terms) t.push_back(zero_loss);
      continue;
    }
    QuantizeOutput o = layers_[static_cast<size_t>(i)]->forward(residual, token_mask);
    // Later layers see a residual cut from the graph (reference issue #33).
    residual = residual - o.quantized.detach();
    outputs.push_back(o.quantized);
    indices.push_back(o.indices);
    losses.push_back(o.loss);
    if (terms.empty()) {
      for (const auto& [name, t] : o.losses) term_names.push_back(name);
      terms.assign(term_names.size(), std::vector<Tensor>(static_cast<size_t>(i), zero_loss));
    }
    for (size_t j = 0; j < term_names.size(); ++j) terms[j].push_back(o.term(term_names[j]));
  }
  if (opts_.shared_codebook && opts_.update_in_forward && is_training()) layers_[0]->update_state();
  const Tensor sum_q = add_n(outputs);
  Tensor y = project_in_ ? project_out_->forward(sum_q) : sum_q;
  QuantizeOutput out;
  out.quantized = layout.from_tokens(y);
  out.indices = layout.spatial_from_tokens(stack(indices, -1));
  out.loss = stack(losses);
  for (size_t j = 0; j < term_names.size(); ++j)
    out.losses.emplace_back(term_names[j], stack(terms[j]));
  return out;
}

Tensor ResidualVQ::get_codes_from_indices(const Tensor& indices) const {
  const int64_t q = num_quantizers();
  if (indices.dim() < 1 || indices.size(-1) > q)
    fail("ResidualVQ", "get_codes_from_indices expects indices [..., q] with q <= " +
                           std::to_string(q) + ", got " + shape_str(indices.shape()));
  std::vector<Tensor> codes;
  for (int64_t i = 0; i < q; ++i) {
    Tensor idx = i < indices.size(-1)
                     ? select(indices, -1, i)
                     : full(Shape(indices.shape().begin(), indices.shape().end() - 1), -1.0,
                            {.dtype = DType::i64});
    codes.push_back(layers_[static_cast<size_t>(i)]->get_codes_from_indices(idx));
  }
  return stack(codes);
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
    : Module("GroupedResidualVQ"), opts_(opts) {
  if (opts_.groups <= 0 || opts_.dim <= 0 || opts_.dim % opts_.groups != 0)
    fail("GroupedResidualVQ", "dim " + std::to_string(opts_.dim) +
                                  " must be a positive multiple of groups " +
                                  std::to_string(opts_.groups));
  auto list = std::make_shared<Module>("ModuleList");
  register_module("rvqs", list);
  for (int64_t g = 0; g < opts_.groups; ++g) {
    ResidualVQOptions ro = opts_.rvq;
    ro.dim = opts_.dim / opts_.groups;
    ro.channel_last = true;
    ro.accept_image_fmap = false;
    auto r = std::make_shared<ResidualVQ>(ro, gen);
    list->register_module(std::to_string(g), r);
    rvqs_.push_back(r);
  }
}

QuantizeOutput GroupedResidualVQ::forward(const Tensor& x, const Tensor& mask) {
  if (x.dim() >= 4 && !opts_.accept_image_fmap)
    fail("GroupedResidualVQ", "got a feature map of shape " + shape_str(x.shape()) +
                                  "; set accept_image_fmap to quantize [B, D, H, W...] inputs");
  const TokenLayout layout(x, opts_.channel_last, opts_.dim, "GroupedResidualVQ");
  const Tensor tokens = layout.to_tokens(x);
  const std::vector<Tensor> parts = chunk(tokens, opts_.groups, -1);
  // One dropout decision, drawn from group 0's stream, for every group.
  ResidualVQ& first = *rvqs_[0];
  const bool dropout =
      is_training() && first.options().quantize_dropout && first.num_quantizers() > 1;
  const int64_t last = dropout ? first.draw_last_layer() : -1;
  std::vector<Tensor> qs, idx, losses;
  const Tensor token_mask =
      mask.defined() ? reshape(mask, {layout.batch(), layout.tokens()}) : Tensor();
  for (int64_t g = 0; g < groups(); ++g) {
    QuantizeOutput o = rvqs_[static_cast<size_t>(g)]->forward_with_last_layer(
        parts[static_cast<size_t>(g)], token_mask, last);
    qs.push_back(o.quantized);
    idx.push_back(layout.spatial_from_tokens(o.indices));
    losses.push_back(o.loss);
  }
  QuantizeOutput out;
  out.quantized = layout.from_tokens(cat(qs, -1));
  out.indices = stack(idx);
  out.loss = stack(losses);
  return out;
}

Tensor GroupedResidualVQ::get_codes_from_indices(const Tensor& indices) const {
  if (indices.dim() < 2 || indices.size(0) != groups())
    fail("GroupedResidualVQ", "get_codes_from_indices expects indices [groups, ..., q], got " +
                                  shape_str(indices.shape()));
  std::vector<Tensor> codes;
  for (int64_t g = 0; g < groups(); ++g)
    codes.push_back(rvqs_[static_cast<size_t>(g)]->get_codes_from_indices(select(indices, 0, g)));
  return stack(codes);
}

Tensor GroupedResidualVQ::get_output_from_indices(const Tensor& indices) {
  std::vector<Tensor> outs;
  for (int64_t g = 0; g < groups(); ++g)
    outs.push_back(rvqs_[static_cast<size_t>(g)]->get_output_from_indices(select(indices, 0, g)));
  return cat(outs, -1);
}

void GroupedResidualVQ::update_state() {
  for (auto& r : rvqs_) r->update_state();
}

void GroupedResidualVQ::set_update_in_forward(bool on) {
  for (auto& r : rvqs_) r->set_update_in_forward(on);
}

}  // namespace quanta::quant
