#include "quant/scalar/fsq.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/scalar/scalar_common.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void fsq_fail(const std::string& what) {
  throw std::invalid_argument("[FSQ] " + what);
}

}  // namespace

FSQ::FSQ(FSQOptions opts, Generator& gen)
    : SingleLayerQuantizer("FSQ"),
      opts_(std::move(opts)),
      seed_(draw_seed(gen)),
      noise_gen_(Generator::named(seed_, "fsq.noise")) {
  const auto& L = opts_.levels;
  if (L.empty()) fsq_fail("levels must not be empty");
  if (opts_.num_codebooks < 1)
    fsq_fail("num_codebooks must be >= 1, got " + std::to_string(opts_.num_codebooks));
  basis_.reserve(L.size());
  for (int64_t l : L) {
    if (l < 2) fsq_fail("every level must be >= 2, got " + std::to_string(l));
    if (l == 2 && !opts_.preserve_symmetry)
      fsq_fail("a level of 2 needs preserve_symmetry = true (otherwise its two codes coincide)");
    basis_.push_back(codebook_size_);
    if (codebook_size_ > std::numeric_limits<int64_t>::max() / l)
      fsq_fail("prod(levels) overflows 64-bit indices");
    codebook_size_ *= l;
  }
  if (opts_.noise_dropout < 0 || opts_.noise_dropout > 1)
    fsq_fail("noise_dropout must lie in [0, 1], got " + std::to_string(opts_.noise_dropout));
  if (opts_.noise_dropout > 0 && !opts_.preserve_symmetry)
    fsq_fail("noise_dropout needs preserve_symmetry = true");
  const int64_t effective = codebook_dim() * opts_.num_codebooks;
  dim_ = opts_.dim > 0 ? opts_.dim : effective;
  keep_codebook_dim_ = opts_.keep_num_codebooks_dim.value_or(opts_.num_codebooks > 1);
  if (opts_.num_codebooks > 1 && !keep_codebook_dim_)
    fsq_fail("keep_num_codebooks_dim = false needs num_codebooks == 1");
  Generator init = Generator::named(seed_, "fsq.init");
  if (dim_ != effective) {
    project_in_ = register_module(
        "project_in", std::make_shared<Linear>(dim_, effective, init, opts_.projection_has_bias));
    project_out_ = register_module(
        "project_out", std::make_shared<Linear>(effective, dim_, init, opts_.projection_has_bias));
  }
  if (opts_.orthogonal_rotation) {
    Generator rot = Generator::named(seed_, "fsq.rotation");
    rotation_ = register_buffer("orthogonal_rot", detail::random_orthogonal(codebook_dim(), rot));
  }
}

Tensor FSQ::per_dim(const std::vector<double>& v, const Tensor& like) const {
  return constant_tensor<double>(v, {static_cast<int64_t>(v.size())},
                                 {.dtype = like.dtype(), .device = like.device()});
}

Tensor FSQ::quantize(const Tensor& z) const {
  const auto& L = opts_.levels;
  const size_t d = L.size();
  if (z.dim() < 1 || z.size(-1) != static_cast<int64_t>(d))
    fsq_fail("quantize expects [..., " + std::to_string(d) + "], got " + shape_str(z.shape()));
  if (opts_.preserve_symmetry) {
    // 2/(L-1) * floor_ste((L-1)(bound(z)+1)/2 + 1/2) - 1
    std::vector<double> lm1(d), step(d);
    for (size_t i = 0; i < d; ++i) {
      lm1[i] = double(L[i] - 1);
      step[i] = 2.0 / double(L[i] - 1);
    }
    const Tensor b = opts_.bound_hard_clamp ? clamp(z, -1.0, 1.0) : tanh(z);
    const Tensor bracket = per_dim(lm1, z) * (b + 1.0) / 2.0 + 0.5;
    return per_dim(step, z) * straight_through(bracket, floor(bracket)) - 1.0;
  }
  // round_ste(tanh(z + shift) * half_l - offset) / (L // 2); the shift centres
  // even level counts, whose grids are asymmetric ({-4..3}/4 for L = 8).
  constexpr double eps = 1e-3;
  std::vector<double> half_l(d), offset(d), shift(d), half_width(d);
  for (size_t i = 0; i < d; ++i) {
    half_l[i] = double(L[i] - 1) * (1 + eps) / 2;
    offset[i] = L[i] % 2 == 0 ? 0.5 : 0.0;
    shift[i] = std::atanh(offset[i] / half_l[i]);
    half_width[i] = double(L[i] / 2);
  }
  const Tensor bounded =
      opts_.bound_hard_clamp
          ? clamp(z, -1.0, 1.0) * per_dim(half_l, z) - per_dim(offset, z)
          : tanh(z + per_dim(shift, z)) * per_dim(half_l, z) - per_dim(offset, z);
  return straight_through(bounded, round(bounded)) / per_dim(half_width, z);
}

Tensor FSQ::codes_to_indices(const Tensor& codes) const {
  const auto& L = opts_.levels;
  const size_t d = L.size();
  if (codes.dim() < 1 || codes.size(-1) != static_cast<int64_t>(d))
    fsq_fail("codes_to_indices expects [..., " + std::to_string(d) + "], got " +
             shape_str(codes.shape()));
  // Level per dimension in [0, L), rounded back to an exact integer.
  std::vector<double> a(d), b(d);
  for (size_t i = 0; i < d; ++i) {
    if (opts_.preserve_symmetry) {
      a[i] = double(L[i] - 1) / 2;  // (code + 1) (L - 1) / 2
      b[i] = a[i];
    } else {
      a[i] = double(L[i] / 2);  // code * (L // 2) + L // 2
      b[i] = a[i];
    }
  }
  const Tensor c = codes.detach().to(DType::f64);
  const Tensor level = round(c * per_dim(a, c) + per_dim(b, c)).to(DType::i64);
  const Tensor basis = constant_tensor<int64_t>(basis_, {static_cast<int64_t>(d)},
                                                {.dtype = DType::i64, .device = codes.device()});
  return sum(level * basis, {-1});
}

Tensor FSQ::indices_to_level_indices(const Tensor& indices) const {
  return detail::index_digits(indices, basis_, opts_.levels, codebook_size_, "FSQ");
}

Tensor FSQ::codes_out(const Tensor& codes, bool project_out) const {
  Tensor c = flatten(codes, codes.dim() - 2, -1);  // [..., C, d] -> [..., C*d]
  if (project_out && project_out_) c = project_out_->forward(c);
  return c;
}

Tensor FSQ::indices_to_codes(const Tensor& indices, bool project_out) const {
  Tensor out = indices_to_grid_codes(indices);
  if (project_out && project_out_) out = project_out_->forward(out);
  const bool image = indices.dim() >= 3 + (keep_codebook_dim_ ? 1 : 0);
  if (image || opts_.channel_first) out = detail::features_to_dim1(out);
  return out;
}

Tensor FSQ::get_codes_from_indices(const Tensor& indices) { return indices_to_grid_codes(indices); }

Tensor FSQ::get_output_from_indices(const Tensor& indices) {
  const Tensor codes = indices_to_grid_codes(indices);
  return project_out_ ? project_out_->forward(codes) : codes;
}

Tensor FSQ::indices_to_grid_codes(const Tensor& indices) const {
  const auto& L = opts_.levels;
  const size_t d = L.size();
  Tensor idx = keep_codebook_dim_ ? indices : unsqueeze(indices, -1);
  if (idx.size(-1) != opts_.num_codebooks)
    fsq_fail("indices_to_codes expects a trailing codebook dim of " +
             std::to_string(opts_.num_codebooks) + ", got " + shape_str(indices.shape()));
  const Tensor level = indices_to_level_indices(idx).to(DType::f32);
  std::vector<double> scale(d), shift(d);
  for (size_t i = 0; i < d; ++i) {
    if (opts_.preserve_symmetry) {  // level * 2/(L-1) - 1
      scale[i] = 2.0 / double(L[i] - 1);
      shift[i] = -1.0;
    } else {  // (level - L//2) / (L//2)
      scale[i] = 1.0 / double(L[i] / 2);
      shift[i] = -1.0;
    }
  }
  Tensor codes = level * per_dim(scale, level) + per_dim(shift, level);
  if (rotation_.defined()) codes = matmul(codes, rotation_.t());
  return codes_out(codes, false);
}

Tensor FSQ::implicit_codebook() const {
  const Tensor all = arange(codebook_size_, {.dtype = DType::i64});
  const Tensor level = indices_to_level_indices(all).to(DType::f32);
  const auto& L = opts_.levels;
  std::vector<double> scale(L.size());
  for (size_t i = 0; i < L.size(); ++i)
    scale[i] = opts_.preserve_symmetry ? 2.0 / double(L[i] - 1) : 1.0 / double(L[i] / 2);
  return level * per_dim(scale, level) - 1.0;
}

QuantizeOutput FSQ::forward(const Tensor& x, const Tensor& mask, const QuantizeOptions&) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const TokenLayout layout(x, !opts_.channel_first, dim_, "FSQ");
  (void)detail::token_mask(mask, layout, "FSQ");  // validated; FSQ tokens are independent
  Tensor z = layout.to_tokens(x);                 // [B, N, D]
  if (project_in_) z = project_in_->forward(z);
  const int64_t B = layout.batch(), N = layout.tokens(), C = opts_.num_codebooks;
  z = reshape(z, {B, N, C, codebook_dim()});
  if (rotation_.defined()) z = matmul(z, rotation_);
  Tensor codes = quantize(z);
  Tensor indices = codes_to_indices(codes);  // [B, N, C]
  if (is_training() && opts_.noise_dropout > 0) {
    // Noise replaces the rounding on a random subset of elements; the indices
    // stay those of the clean codes.
    // One next() per forward: a pinned stream restarts at the step's offset.
    Generator& gen = noise_gen_.next();
    const Tensor drop = bernoulli(codes.shape(), opts_.noise_dropout, gen,
                                  {.dtype = DType::boolean, .device = codes.device()});
    const Tensor noise =
        (rand(codes.shape(), gen, {.device = codes.device()}) - 0.5).to(codes.dtype());
    codes = where(drop, clamp(codes + noise, -1.0, 1.0), codes);
  }
  if (rotation_.defined()) codes = matmul(codes, rotation_.t());
  QuantizeOutput out;
  out.quantized = layout.from_tokens(codes_out(codes, true));
  if (!keep_codebook_dim_) indices = squeeze(indices, -1);
  indices =
      indices.to(codebook_size_ <= std::numeric_limits<int32_t>::max() ? DType::i32 : DType::i64);
  out.indices = layout.spatial_from_tokens(indices);
  out.loss = zeros({}, options_of(out.quantized));
  return out;
}

Tensor FSQ::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

}  // namespace quanta::quant
