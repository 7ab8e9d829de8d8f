#include "quant/scalar/fsp.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/scalar/scalar_common.h"
#include "quant/streams.h"
#include "quant/token_layout.h"

namespace quanta::quant {
namespace {

[[noreturn]] void fsp_fail(const std::string& what) {
  throw std::invalid_argument("[FSP] " + what);
}

constexpr double kPi = 3.14159265358979323846;
// 1 / sqrt(12): the standard deviation of U(0, 1), which the midpoints take.
constexpr double kUniformStd = 0.28867513459481287;

struct NormPreset {
  const char* name;
  double targets[4], weights[4];  // mean, variance, skewness, kurtosis
};

// The reference's VectorNorm presets.
constexpr NormPreset kPresets[] = {
    {"none", {0, 1, 0, 0}, {0, 0, 0, 0}},
    {"var", {0, 1, 0, 0}, {0.1, 0.07, 0, 0}},
    {"kurt", {0, 1, 0, 0}, {0.1, 0.07, 0.06, 0.05}},
    {"var_tanh", {0, 0.8225, 0, 0}, {0.1, 0.07, 0, 0}},
    {"var_sigmoid", {0, 3.29, 0, 0}, {0.1, 0.07, 0, 0}},
    {"var_laplace", {0, 2.0, 0, 0}, {0.1, 0.07, 0, 0}},
};

}  // namespace

FSP::FSP(FSPOptions opts, Generator& gen)
    : SingleLayerQuantizer("FSP"), opts_(std::move(opts)), perturb_gen_(Generator(0)) {
  const uint64_t seed = draw_seed(gen);
  perturb_gen_ = StepStream(Generator::named(seed, "fsp.perturb"));
  if (opts_.levels.empty()) fsp_fail("levels must not be empty");
  for (int64_t l : opts_.levels) {
    if (l < 2) fsp_fail("every level must be >= 2, got " + std::to_string(l));
    basis_.push_back(codebook_size_);
    if (codebook_size_ > std::numeric_limits<int32_t>::max() / l)
      fsp_fail("prod(levels) overflows the int32 indices");
    codebook_size_ *= l;
  }
  if (!(opts_.quantize_rate >= 0 && opts_.quantize_rate <= 1))
    fsp_fail("quantize_rate must lie in [0, 1], got " + std::to_string(opts_.quantize_rate));
  const std::string& a = opts_.act_name;
  if (a != "tanh" && a != "sigmoid" && a != "normal" && a != "laplace" && a != "cauchy")
    fsp_fail("act_name must be one of tanh, sigmoid, normal, laplace, cauchy, got '" + a + "'");
  bool found = false;
  for (const NormPreset& p : kPresets)
    if (opts_.vector_norm == p.name) {
      norm_targets_.assign(p.targets, p.targets + 4);
      norm_weights_.assign(p.weights, p.weights + 4);
      found = true;
    }
  if (!found)
    fsp_fail(
        "vector_norm must be one of none, var, kurt, var_tanh, var_sigmoid, var_laplace, got '" +
        opts_.vector_norm + "'");
  const int64_t d = static_cast<int64_t>(opts_.levels.size());
  dim_ = opts_.dim > 0 ? opts_.dim : d;
  Generator init = Generator::named(seed, "fsp.init");
  if (dim_ != d) {
    project_in_ = register_module(
        "project_in", std::make_shared<Linear>(dim_, d, init, opts_.projection_has_bias));
    project_out_ = register_module(
        "project_out", std::make_shared<Linear>(d, dim_, init, opts_.projection_has_bias));
  }
}

// (-inf, inf) -> [0, 1], differentiable.
Tensor FSP::activate(const Tensor& z) const {
  const std::string& a = opts_.act_name;
  if (a == "tanh") return (tanh(z) + 1.0) * 0.5;
  if (a == "sigmoid") return sigmoid(z);
  if (a == "normal") return (erf(z * (1.0 / std::sqrt(2.0))) + 1.0) * 0.5;
  if (a == "laplace") return (sign(z) * (1.0 - exp(-abs(z))) + 1.0) * 0.5;
  return atan(z) * (1.0 / kPi) + 0.5;  // cauchy
}

// (0, 1) -> (-inf, inf); its value only (the gradient goes straight through).
Tensor FSP::inverse_activation(const Tensor& p) const {
  NoGradGuard value_only;
  const std::string& a = opts_.act_name;
  if (a == "tanh") return log(p / (1.0 - p)) * 0.5;  // atanh(2p - 1)
  if (a == "sigmoid") return log(p / (1.0 - p));
  if (a == "normal") return erfinv(p * 2.0 - 1.0) * std::sqrt(2.0);
  if (a == "laplace") return -sign(p - 0.5) * log(1.0 - abs(p - 0.5) * 2.0);
  const Tensor angle = (p - 0.5) * kPi;  // cauchy: tan
  return sin(angle) / cos(angle);
}

// The statistics loss of the reference's VectorNorm over the tokens z [T, d]:
// per-dimension batch mean, unbiased variance, skewness and excess kurtosis
// against the preset's targets, each weighted; terms of weight 0 are skipped.
Tensor FSP::statistics_loss(const Tensor& z) const {
  Tensor loss = zeros({}, options_of(z));
  if (norm_weights_[0] == 0 && norm_weights_[1] == 0 && norm_weights_[2] == 0 &&
      norm_weights_[3] == 0)
    return loss;
  const Tensor m = mean(z, {0});
  const Tensor v = var(z, {0}, 1.0);
  const auto term = [&](int i, const Tensor& stat) {
    if (norm_weights_[size_t(i)] != 0)
      loss = loss + mean(square(stat - norm_targets_[size_t(i)])) * norm_weights_[size_t(i)];
  };
  term(0, m);
  term(1, v);
  if (norm_weights_[2] != 0 || norm_weights_[3] != 0) {
    const Tensor scores = (z - m) / clamp(sqrt(v), 1e-8, std::numeric_limits<double>::infinity());
    term(2, mean(pow(scores, 3.0), {0}));
    term(3, mean(pow(scores, 4.0), {0}) - 3.0);
  }
  return loss;
}

// Bins [..., d] (any integer or float dtype) -> codes [..., d].
Tensor FSP::codes_from_bins(const Tensor& bins, const Tensor& levels) const {
  const Tensor p = (to_dtype(bins, levels.dtype()) + 0.5) / levels;
  if (!opts_.need_inv_act) return (p - 0.5) * (1.0 / kUniformStd);
  const double eps = 1e-6;
  return inverse_activation(clamp(p, eps, 1.0 - eps));
}

QuantizeOutput FSP::forward(const Tensor& x, const Tensor& mask, const QuantizeOptions&) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const TokenLayout layout(x, !opts_.channel_first, dim_, "FSP");
  (void)detail::token_mask(mask, layout, "FSP");
  const int64_t b = layout.batch(), n = layout.tokens(), d = int64_t(opts_.levels.size());
  Tensor z = reshape(layout.to_tokens(x), {b * n, dim_});
  if (project_in_) z = project_in_->forward(z);
  const Tensor loss = statistics_loss(z);
  const double eps = z.dtype() == DType::f64 ? std::numeric_limits<double>::epsilon()
                                             : double(std::numeric_limits<float>::epsilon());
  std::vector<double> lv(opts_.levels.begin(), opts_.levels.end());
  const Tensor levels = constant_tensor<double>(lv, {d}, options_of(z));
  const Tensor act = activate(z);
  Tensor bins;
  {
    NoGradGuard no_grad;
    bins = floor(clamp(act.detach(), -std::numeric_limits<double>::infinity(), 1.0 - eps) * levels);
  }
  Tensor code_act = straight_through(act, (bins + 0.5) / levels);
  Tensor accepted = zeros({}, options_of(z));
  if (is_training() && opts_.quantize_rate < 1.0) {
    Generator& gen = perturb_gen_.next();  // one next() per forward: a pinned stream restarts
    const auto draw = [&](const std::string& what) {
      return uniform_draws
                 ? to_dtype(uniform_draws(what, act.shape(), options_of(act)), act.dtype())
                 : rand(act.shape(), gen, options_of(act));
    };
    // Uniform within half a bin of the activation, kept where it stays in (0, 1).
    const Tensor offset = (draw("perturbation") * 2.0 - 1.0) / (levels * 2.0);
    const Tensor proposal = act + offset;
    const Tensor inside = logical_and(gt(proposal, constant_like(proposal, 0.0)),
                                      lt(proposal, constant_like(proposal, 1.0)));
    accepted = mean(to_dtype(inside, z.dtype()));
    const Tensor perturbed = where(inside, proposal, act);
    const Tensor perturb = gt(draw("keep"), constant_like(act, opts_.quantize_rate));
    code_act = where(perturb, perturbed, code_act);
  }
  Tensor q = opts_.need_inv_act
                 ? straight_through(z, inverse_activation(clamp(code_act.detach(), eps, 1.0 - eps)))
                 : (code_act - 0.5) * (1.0 / kUniformStd);
  if (project_out_) q = project_out_->forward(q);
  Tensor indices;
  {
    NoGradGuard no_grad;
    std::vector<double> bv(basis_.begin(), basis_.end());
    indices =
        to_dtype(sum(bins * constant_tensor<double>(bv, {d}, options_of(z)), {-1}), DType::i32);
  }
  QuantizeOutput out;
  out.quantized = layout.from_tokens(reshape(q, {b, n, dim_}));
  out.indices = layout.spatial_from_tokens(reshape(indices, {b, n}));
  out.loss = loss;
  out.losses = {{"vector_norm", loss}, {"p_accept_prob", accepted}};
  return out;
}

Tensor FSP::forward(const Tensor& x) { return forward(x, Tensor()).quantized; }

Tensor FSP::indices_to_level_indices(const Tensor& indices) const {
  return detail::index_digits(indices, basis_, opts_.levels, codebook_size_, "FSP");
}

Tensor FSP::get_codes_from_indices(const Tensor& indices) {
  std::vector<double> lv(opts_.levels.begin(), opts_.levels.end());
  const Tensor levels = from_vector<double>(lv, {int64_t(lv.size())}).to(indices.device());
  return codes_from_bins(indices_to_level_indices(indices), levels);
}

Tensor FSP::get_output_from_indices(const Tensor& indices) {
  Tensor codes = get_codes_from_indices(indices);
  if (project_out_) codes = project_out_->forward(codes);
  return codes;
}

}  // namespace quanta::quant
