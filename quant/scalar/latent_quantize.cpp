#include "quant/scalar/latent_quantize.h"

#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/loss.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "quant/scalar/scalar_common.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void latent_fail(const std::string& what) {
  throw std::invalid_argument("[LatentQuantize] " + what);
}

}  // namespace

LatentQuantize::LatentQuantize(LatentQuantizeOptions opts, Generator& gen)
    : SingleLayerQuantizer("LatentQuantize"), opts_(std::move(opts)) {
  const uint64_t seed = draw_seed(gen);
  if (opts_.levels.empty()) latent_fail("levels must not be empty");
  if (opts_.codebook_dim < 0)
    latent_fail("codebook_dim must be >= 0, got " + std::to_string(opts_.codebook_dim));
  // One level for every code dimension: the reference's int levels.
  if (opts_.levels.size() == 1 && opts_.codebook_dim > 1)
    opts_.levels.assign(static_cast<size_t>(opts_.codebook_dim), opts_.levels[0]);
  if (opts_.codebook_dim > 0 && opts_.codebook_dim != static_cast<int64_t>(opts_.levels.size()))
    latent_fail("codebook_dim " + std::to_string(opts_.codebook_dim) + " does not match the " +
                std::to_string(opts_.levels.size()) + " levels");
  if (opts_.num_codebooks < 1) latent_fail("num_codebooks must be >= 1");
  auto list = register_module("values_per_latent", std::make_shared<Module>("ParameterList"));
  for (size_t i = 0; i < opts_.levels.size(); ++i) {
    const int64_t l = opts_.levels[i];
    if (l < 2) latent_fail("every level must be >= 2, got " + std::to_string(l));
    basis_.push_back(codebook_size_);
    codebook_size_ *= l;
    // From -1/2, with 0 on the grid: linspace(-1/2, 1/2, L) for odd L,
    // i / L - 1/2 for even L (the reference's values_per_latent).
    const Tensor grid =
        l % 2 == 1 ? linspace(-0.5, 0.5, l) : linspace(-0.5, 0.5 - 1.0 / double(l), l);
    values_.push_back(opts_.optimize_values ? list->register_parameter(std::to_string(i), grid)
                                            : list->register_buffer(std::to_string(i), grid));
  }
  const int64_t d = static_cast<int64_t>(opts_.levels.size());
  const int64_t effective = d * opts_.num_codebooks;
  dim_ = opts_.dim > 0 ? opts_.dim : effective;
  keep_codebook_dim_ = opts_.keep_num_codebooks_dim.value_or(opts_.num_codebooks > 1);
  if (opts_.num_codebooks > 1 && !keep_codebook_dim_)
    latent_fail("keep_num_codebooks_dim = false needs num_codebooks == 1");
  Generator init = Generator::named(seed, "latent_quantize.init");
  if (dim_ != effective) {
    project_in_ = register_module("project_in", std::make_shared<Linear>(dim_, effective, init));
    project_out_ = register_module("project_out", std::make_shared<Linear>(effective, dim_, init));
  }
}

Tensor LatentQuantize::codes_to_indices(const Tensor& z) const {
  const int64_t d = static_cast<int64_t>(opts_.levels.size());
  if (z.dim() < 1 || z.size(-1) != d)
    latent_fail("expected [..., " + std::to_string(d) + "], got " + shape_str(z.shape()));
  Tensor index;
  for (int64_t i = 0; i < d; ++i) {
    // nearest grid value (first on ties), as the reference's argmin |z - v|
    const Tensor v = values_[i].detach().to(z.dtype());
    const Tensor pos = argmin(abs(unsqueeze(select(z.detach(), -1, i), -1) - v), -1);
    const Tensor term = mul(pos, shared_full({}, double(basis_[i]), options_of(pos)));
    index = index.defined() ? index + term : term;
  }
  return index;
}

Tensor LatentQuantize::quantize(const Tensor& z) const {
  const int64_t d = static_cast<int64_t>(opts_.levels.size());
  if (z.dim() < 1 || z.size(-1) != d)
    latent_fail("expected [..., " + std::to_string(d) + "], got " + shape_str(z.shape()));
  std::vector<Tensor> cols;
  for (int64_t i = 0; i < d; ++i) {
    const Tensor v = values_[i].to(z.dtype());
    const Tensor zi = select(z, -1, i);
    const Tensor pos = argmin(abs(unsqueeze(zi.detach(), -1) - v.detach()), -1);
    cols.push_back(index_select(v, 0, flatten(pos)).reshape(zi.shape()));
  }
  return straight_through(z, stack(cols, -1));
}

Tensor LatentQuantize::indices_to_codes(const Tensor& indices, bool project_out) const {
  const Tensor idx = keep_codebook_dim_ ? indices : unsqueeze(indices, -1);
  if (idx.size(-1) != opts_.num_codebooks)
    latent_fail("indices need a trailing codebook dim of " + std::to_string(opts_.num_codebooks));
  const Tensor flat = flatten(idx.to(DType::i64));
  const std::vector<int64_t> v = flat.to_vector<int64_t>();
  std::vector<Tensor> cols;
  for (size_t i = 0; i < opts_.levels.size(); ++i) {
    std::vector<int64_t> pos(v.size());
    for (size_t t = 0; t < v.size(); ++t) {
      if (v[t] < 0 || v[t] >= codebook_size_)
        latent_fail("index " + std::to_string(v[t]) + " out of range");
      pos[t] = (v[t] / basis_[i]) % opts_.levels[i];
    }
    cols.push_back(
        index_select(values_[i].detach(), 0,
                     from_vector<int64_t>(pos, {int64_t(pos.size())},
                                          {.dtype = DType::i64, .device = values_[i].device()})));
  }
  Shape s = idx.shape();
  s.back() *= static_cast<int64_t>(opts_.levels.size());
  Tensor codes = reshape(stack(cols, -1), s);
  if (project_out && project_out_) codes = project_out_->forward(codes);
  return codes;
}

QuantizeOutput LatentQuantize::forward(const Tensor& x, const Tensor& mask,
                                       const QuantizeOptions&) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const TokenLayout layout(x, true, dim_, "LatentQuantize");
  (void)detail::token_mask(mask, layout, "LatentQuantize");
  Tensor z = layout.to_tokens(x);
  const Tensor original = z;
  if (project_in_) z = project_in_->forward(z);
  const int64_t B = layout.batch(), N = layout.tokens(), C = opts_.num_codebooks;
  const int64_t d = static_cast<int64_t>(opts_.levels.size());
  z = reshape(z, {B, N, C, d});
  const Tensor codes = quantize(z);
  Tensor indices = codes_to_indices(z).to(DType::i32);
  Tensor y = reshape(codes, {B, N, C * d});
  if (project_out_) y = project_out_->forward(y);
  QuantizeOutput out;
  out.quantized = layout.from_tokens(y);
  if (!keep_codebook_dim_) indices = squeeze(indices, -1);
  out.indices = layout.spatial_from_tokens(indices);
  const Tensor zero = zeros({}, options_of(y));
  Tensor commit = zero, quant = zero;
  if (is_training() && y.numel() > 0) {
    commit = mse_loss(y, original.detach());
    quant = mse_loss(y.detach(), original);
  }
  out.loss = commit * opts_.commitment_loss_weight + quant * opts_.quantization_loss_weight;
  out.losses = {{"commitment", commit}, {"quantization", quant}};
  return out;
}

Tensor LatentQuantize::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
