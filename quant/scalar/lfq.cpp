#include "quant/scalar/lfq.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/scalar/scalar_common.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void lfq_fail(const std::string& what) {
  throw std::invalid_argument("[LFQ] " + what);
}

}  // namespace

LFQ::LFQ(LFQOptions opts, Generator& gen)
    : SingleLayerQuantizer("LFQ"),
      opts_(std::move(opts)),
      seed_(draw_seed(gen)),
      sample_gen_(StepStream(Generator::named(seed_, "lfq.entropy_tokens"))) {
  if (opts_.num_codebooks < 1)
    lfq_fail("num_codebooks must be >= 1, got " + std::to_string(opts_.num_codebooks));
  if (opts_.codebook_size > 0) {
    codebook_size_ = opts_.codebook_size;
    if ((codebook_size_ & (codebook_size_ - 1)) != 0)
      lfq_fail("codebook_size must be a power of two, got " + std::to_string(codebook_size_));
    while ((int64_t{1} << bits_) < codebook_size_) ++bits_;
  } else {
    if (opts_.dim <= 0) lfq_fail("give dim or codebook_size");
    bits_ = opts_.dim;
    if (bits_ > 62) lfq_fail("2^dim codes overflow 64-bit indices: dim = " + std::to_string(bits_));
    codebook_size_ = int64_t{1} << bits_;
  }
  if (bits_ < 1) lfq_fail("codebook_size must be >= 2");
  if (opts_.frac_per_sample_entropy <= 0 || opts_.frac_per_sample_entropy > 1)
    lfq_fail("frac_per_sample_entropy must lie in (0, 1], got " +
             std::to_string(opts_.frac_per_sample_entropy));
  const int64_t effective = bits_ * opts_.num_codebooks;
  dim_ = opts_.dim > 0 ? opts_.dim : effective;
  const bool proj = opts_.has_projections.value_or(dim_ != effective);
  if (!proj && dim_ != effective)
    lfq_fail("dim " + std::to_string(dim_) + " != codebook_dim * num_codebooks = " +
             std::to_string(effective) + " needs projections");
  keep_codebook_dim_ = opts_.keep_num_codebooks_dim.value_or(opts_.num_codebooks > 1);
  if (opts_.num_codebooks > 1 && !keep_codebook_dim_)
    lfq_fail("keep_num_codebooks_dim = false needs num_codebooks == 1");
  Generator init = Generator::named(seed_, "lfq.init");
  if (proj) {
    project_in_ = register_module(
        "project_in", std::make_shared<Linear>(dim_, effective, init, opts_.projection_has_bias));
    project_out_ = register_module(
        "project_out", std::make_shared<Linear>(effective, dim_, init, opts_.projection_has_bias));
  }
  std::vector<int64_t> bits(static_cast<size_t>(bits_));
  for (int64_t j = 0; j < bits_; ++j) bits[j] = int64_t{1} << (bits_ - 1 - j);
  bit_mask_ = register_buffer("mask", from_vector<int64_t>(bits, {bits_}));
}

Tensor LFQ::codebook() const {
  std::vector<float> out(static_cast<size_t>(codebook_size_ * bits_));
  for (int64_t k = 0; k < codebook_size_; ++k)
    for (int64_t j = 0; j < bits_; ++j)
      out[k * bits_ + j] =
          float(((k >> (bits_ - 1 - j)) & 1) ? opts_.codebook_scale : -opts_.codebook_scale);
  return from_vector<float>(out, {codebook_size_, bits_});
}

Tensor LFQ::entropy_codebook(const Tensor& like) const {
  Tensor c = codebook().to(like.dtype()).to(like.device());
  if (opts_.spherical) c = c / std::sqrt(double(bits_));
  return c;
}

Tensor LFQ::indices_to_grid_codes(const Tensor& indices) const {
  if (is_floating(indices.dtype()))
    lfq_fail("indices must be integers, got " + std::string(dtype_name(indices.dtype())));
  const Tensor idx = keep_codebook_dim_ ? indices : unsqueeze(indices, -1);
  const int64_t C = opts_.num_codebooks;
  if (idx.dim() < 1 || idx.size(-1) != C)
    lfq_fail("indices need a trailing codebook dim of " + std::to_string(C) + ", got " +
             shape_str(indices.shape()));
  const double m =
      opts_.spherical ? opts_.codebook_scale / std::sqrt(double(bits_)) : opts_.codebook_scale;
  const std::vector<int64_t> v = idx.to_vector<int64_t>();
  std::vector<float> out(v.size() * static_cast<size_t>(bits_));
  for (size_t t = 0; t < v.size(); ++t) {
    if (v[t] < 0 || v[t] >= codebook_size_)
      lfq_fail("index " + std::to_string(v[t]) + " outside [0, " + std::to_string(codebook_size_) +
               ")");
    for (int64_t j = 0; j < bits_; ++j)
      out[t * bits_ + j] = float(((v[t] >> (bits_ - 1 - j)) & 1) ? m : -m);
  }
  Shape s(idx.shape().begin(), idx.shape().end() - 1);
  s.push_back(C * bits_);
  return from_vector<float>(out, s).to(indices.device());
}

Tensor LFQ::indices_to_codes(const Tensor& indices, bool project_out) const {
  Tensor out = indices_to_grid_codes(indices);
  if (project_out && project_out_) out = project_out_->forward(out);
  const bool image = indices.dim() >= 3 + (keep_codebook_dim_ ? 1 : 0);
  if (image || opts_.channel_first) out = detail::features_to_dim1(out);
  return out;
}

Tensor LFQ::get_codes_from_indices(const Tensor& indices) { return indices_to_grid_codes(indices); }

Tensor LFQ::get_output_from_indices(const Tensor& indices) {
  const Tensor codes = indices_to_grid_codes(indices);
  return project_out_ ? project_out_->forward(codes) : codes;
}

QuantizeOutput LFQ::forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const double inv_t = opts.inv_temperature > 0 ? opts.inv_temperature : opts_.inv_temperature;
  const TokenLayout layout(x, !opts_.channel_first, dim_, "LFQ");
  const Tensor keep = detail::token_mask(mask, layout, "LFQ");
  Tensor z = layout.to_tokens(x);
  if (project_in_) z = project_in_->forward(z);
  if (opts_.soft_clamp_input_value > 0)
    z = detail::soft_clamp(z, constant_like(z, opts_.soft_clamp_input_value));
  const int64_t B = layout.batch(), N = layout.tokens(), C = opts_.num_codebooks, d = bits_;
  z = reshape(z, {B, N, C, d});
  const double s = opts_.codebook_scale;
  // m: the magnitude of every code component as the layer uses it.
  const double m = opts_.spherical ? s / std::sqrt(double(d)) : s;
  if (opts_.spherical) z = z / clamp(norm(z, 2.0, {-1}, true), 1e-12, NAN) * s;
  const Tensor positive = gt(z, constant_like(z, 0.0));
  const Tensor q = where(positive, constant_like(z, m), constant_like(z, -m));
  Tensor indices = sum(positive.to(DType::i64) * bit_mask_, {-1});  // [B, N, C]

  QuantizeOutput out;
  const Tensor zero = zeros({}, options_of(z));
  Tensor per_sample = zero, batch = zero, commitment = zero, loss = zero;
  if (is_training()) {
    // Tokens that count: the unmasked ones, optionally a random subset.
    Tensor zt = reshape(z, {B * N, C, d});
    Tensor qt = reshape(q, {B * N, C, d});
    if (keep.defined()) {
      const Tensor rows = nonzero(reshape(keep, {B * N}).to(DType::boolean));
      zt = index_select(zt, 0, rows);
      qt = index_select(qt, 0, rows);
    }
    const int64_t T = zt.size(0);
    Tensor ze = zt;
    if (opts_.frac_per_sample_entropy < 1) {
      const auto n = static_cast<int64_t>(double(T) * opts_.frac_per_sample_entropy);
      ze = index_select(
          zt, 0,
          slice(randperm(T, sample_gen_.next(), {.dtype = DType::i64, .device = zt.device()}), 0, 0,
                n));
    }
    const LFQEntropy h = opts_.entropy_path == LFQEntropyPath::direct
                             ? lfq_entropy_direct(ze, entropy_codebook(ze), inv_t, token_mean)
                             : lfq_entropy_factorised(ze * (4.0 * inv_t * m), token_mean);
    per_sample = h.per_sample;
    batch = h.batch;
    // A token mean too (every rank calls token_mean, even with no tokens).
    if (opts_.commitment_loss_weight > 0)
      commitment = token_mean(sum(square(zt - qt.detach())) / double(C * d), T);
    loss = (per_sample - batch * opts_.diversity_gamma) * opts_.entropy_loss_weight +
           commitment * opts_.commitment_loss_weight;
  }
  const Tensor coded = is_training() ? straight_through(z, q) : q.detach();
  Tensor y = reshape(coded, {B, N, C * d});
  if (project_out_) y = project_out_->forward(y);
  out.quantized = layout.from_tokens(y);
  if (!keep_codebook_dim_) indices = squeeze(indices, -1);
  out.indices = layout.spatial_from_tokens(indices);
  out.loss = loss;
  out.losses = {
      {"per_sample_entropy", per_sample}, {"batch_entropy", batch}, {"commitment", commitment}};
  return out;
}

Tensor LFQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
