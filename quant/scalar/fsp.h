#pragma once
// FSP: finite scalar perturbation (VP-VAE, arXiv 2602.17133; the reference's
// finite_scalar_perturbation.py). Each code dimension is mapped into [0, 1]
// by a CDF activation and cut into L_i equal bins; the code is the bin's
// midpoint. In training a fraction of the elements instead moves uniformly
// within half a bin of its activation, which smooths the gradient and
// regularises, and a statistics loss keeps the latent's batch moments near
// the activation's (the "vector norm").
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/step_stream.h"

namespace quanta::quant {

/** FSP settings; names and defaults are the reference's. */
struct FSPOptions {
  /** Bins per code dimension (each >= 2). */
  std::vector<int64_t> levels;
  /** Input features; 0 = len(levels) (no projections). */
  int64_t dim = 0;
  /** Inputs of rank 3 are [B, D, N] (rank >= 4 inputs are always channel first). */
  bool channel_first = false;
  /** Bias in project_in / project_out. */
  bool projection_has_bias = true;
  /** The CDF activation into [0, 1]: "tanh" ((tanh z + 1) / 2), "sigmoid",
   * "normal" (the Gaussian CDF), "laplace" or "cauchy". */
  std::string act_name = "tanh";
  /** Training: the fraction of elements quantized to their bin's midpoint;
   * the others are perturbed within their bin (eval quantizes all). */
  double quantize_rate = 0.0;
  /** The code is the activation's inverse at the bin midpoint (the gradient
   * passes straight through to the latent); false: the midpoint rescaled to
   * unit variance, (p - 1/2) sqrt(12). */
  bool need_inv_act = false;
  /** The statistics loss's preset: "none", "var" (mean 0, variance 1),
   * "kurt" (and skewness 0, excess kurtosis 0), "var_tanh" (variance
   * 0.8225), "var_sigmoid" (3.29) or "var_laplace" (2). */
  std::string vector_norm = "var_tanh";
};

class FSP : public SingleLayerQuantizer, public StepKeyed {
 public:
  /** Builds the layer seeded with the next 64 bits of `gen` (draw_seed): the
   * projections' initialisation and the perturbation stream "fsp.perturb". */
  FSP(FSPOptions opts, Generator& gen);
  /** Keys the perturbation stream by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { perturb_gen_.pin(step); }
  /** Quantizes x ([B, D], [B, N, D], [B, D, N] with channel_first, or
   * [B, D, H, W...]); indices int32. loss is the statistics loss over the
   * batch's tokens (in eval too, as the reference), term "vector_norm"; in
   * training with quantize_rate < 1 also "p_accept_prob", the fraction of
   * perturbations that stayed inside [0, 1]. `mask` is validated and
   * otherwise unused (the statistics see every token, as the reference's). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  Tensor forward(const Tensor& x) override;
  /** Indices -> per-dimension bins [..., d] (int32). */
  Tensor indices_to_level_indices(const Tensor& indices) const;
  /** Indices -> codes [..., d] before project_out. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** Indices -> project_out(codes), [..., dim] (features last, as every
   * quantizer's; the reference's indices_to_codes puts them first with
   * channel_first). */
  Tensor get_output_from_indices(const Tensor& indices) override;
  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return 1; }
  const FSPOptions& options() const { return opts_; }

  /** Uniform [0, 1) draws of `shape` for the training perturbation, `what`
   * being "perturbation" (the offset within the bin) or "keep" (which
   * elements are perturbed): by default from the "fsp.perturb" step stream.
   * Replaced to replay another implementation's draws (`quanta parity`). */
  using UniformSource =
      std::function<Tensor(const std::string& what, const Shape& shape, const TensorOptions& opts)>;
  UniformSource uniform_draws;

 private:
  Tensor activate(const Tensor& z) const;
  Tensor inverse_activation(const Tensor& p) const;
  Tensor codes_from_bins(const Tensor& bins, const Tensor& levels) const;
  Tensor statistics_loss(const Tensor& z) const;

  FSPOptions opts_;
  int64_t dim_ = 0, codebook_size_ = 1;
  std::vector<int64_t> basis_;
  std::vector<double> norm_targets_, norm_weights_;  // mean, variance, skewness, kurtosis
  std::shared_ptr<Linear> project_in_, project_out_;
  StepStream perturb_gen_;
};

}  // namespace quanta::quant
