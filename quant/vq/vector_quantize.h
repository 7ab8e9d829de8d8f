#pragma once
// VectorQuantize: nearest-code quantization with an EMA-trained codebook,
// following vector-quantize-pytorch 1.32.0 option by option (docs/vq.md).
//
// State updates are explicit: a training forward only ACCUMULATES statistics
// into the codebook's pending CodebookStatistics; update_state() (EMA step
// with Laplace smoothing, then dead-code expiry) applies them. With
// update_in_forward (the default) every training forward ends with
// update_state(), which reproduces the reference exactly on one process; a
// distributed wrapper turns it off and reduces the statistics across ranks
// before calling update_state() itself.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/step_stream.h"
#include "quant/vq/codebook.h"
#include "quant/vq/codebook_transform.h"

namespace quanta::quant {

/** VectorQuantize options: the reference's names and defaults. */
struct VectorQuantizeOptions {
  /** Feature size of the input (required). */
  int64_t dim = 0;
  /** Number of codes K (required). */
  int64_t codebook_size = 0;
  /** Size of a code; 0 = dim. Linear project_in / project_out are added when
   * heads * codebook_dim != dim. */
  int64_t codebook_dim = 0;
  /** Each token is split into `heads` vectors of codebook_dim. */
  int64_t heads = 1;
  /** One codebook per head (else all heads share one). */
  bool separate_codebook_per_head = false;
  /** EMA decay of cluster sizes and code sums. */
  double decay = 0.8;
  /** Laplace smoothing epsilon of the EMA update. */
  double eps = 1e-5;
  /** Initialise the codes by k-means on the first batch (train or eval). */
  bool kmeans_init = false;
  int64_t kmeans_iters = 10;
  /** Cosine similarity: inputs and codes are l2-normalised. */
  bool use_cosine_sim = false;
  /** LayerNorm after project_in (project_in becomes Sequential(Linear,
   * LayerNorm), state keys project_in.0.* and project_in.1.*). */
  bool layernorm_after_project_in = false;
  /** Replace codes whose EMA cluster size falls below this (0 = off) with
   * rows of the current batch. */
  double threshold_ema_dead_code = 0;
  /** Features last ([B, N, D]); false: [B, D, N]. */
  bool channel_last = true;
  /** Accept image / video feature maps [B, D, H, W(, T)]. */
  bool accept_image_fmap = false;
  /** Weight of the commitment loss. */
  double commitment_weight = 1.0;
  /** Commitment as cross entropy of the distances against the chosen codes. */
  bool commitment_use_cross_entropy_loss = false;
  /** Weight of the orthogonal regulariser (> 0 makes embed a parameter). */
  double orthogonal_reg_weight = 0;
  /** Orthogonal loss only over the codes used in this batch. */
  bool orthogonal_reg_active_codes_only = false;
  /** At most this many random codes in the orthogonal loss (0 = all). */
  int64_t orthogonal_reg_max_codes = 0;
  /** Weight of the codebook diversity (negative entropy) loss. */
  double codebook_diversity_loss_weight = 0;
  double codebook_diversity_temperature = 100;
  /** Gumbel-sample codes from softmax(-distance / T) in training. */
  bool stochastic_sample_codes = false;
  /** T of stochastic sampling and of the gumbel straight-through softmax. */
  double sample_codebook_temp = 1.0;
  /** Gumbel-softmax straight-through: one-hot + softmax - sg(softmax). */
  bool straight_through = false;
  /** Rotation trick gradient (default: on when dim > 1 and
   * directional_reparam is off), else the STE. */
  std::optional<bool> rotation_trick;
  /** DiVeQ: the output is x + sg(n) |q - x| with n the unit direction of
   * (q - x) + sqrt(directional_reparam_variance) * noise (quant/vq/
   * directional_reparam.h), so the codes learn by gradient. Implies no
   * commitment loss, and by default a learnable codebook without the EMA
   * update; needs threshold_ema_dead_code > 0 (the reference asserts it). */
  bool directional_reparam = false;
  double directional_reparam_variance = 5e-3;
  /** FVQ's bridge: a module mapping the codes [G, K, codebook_dim] to codes
   * of the same shape, which the layer then quantizes with (its codebook
   * transform, quant/vq/codebook_transform.h), registered as
   * _codebook.vq_bridge (every layer given the same module shares it).
   * Needs a learnable codebook without the EMA update (the defaults then),
   * Euclidean distances, as the reference asserts. */
  std::shared_ptr<Module> vq_bridge;
  /** Codebook trained by gradient (commitment not detached). Default:
   * directional_reparam or a vq_bridge. */
  std::optional<bool> learnable_codebook;
  /** EMA codebook update. Default: neither directional_reparam nor a
   * vq_bridge. */
  std::optional<bool> ema_update;
  /** Route the output gradient to the input (rotation trick, STE or DiVeQ);
   * false: the output is the code itself, and only a learnable codebook
   * receives its gradient (ResidualVQ's diveq sets this). */
  bool route_gradients_to_input = true;
  /** Masked tokens output zeros; false: they output the input unchanged. */
  bool return_zeros_for_masked_padding = true;
  /** No statistics, no update. */
  bool freeze_codebook = false;
  /** Codes follow the running mean / variance of the inputs:
   * distances use (c - mean_cb) std_b / std_cb + mean_b; the EMA sees the
   * inputs mapped back. Running statistics update in training forwards. */
  bool affine_param = false;
  double affine_param_batch_decay = 0.99;
  double affine_param_codebook_decay = 0.9;
  /** q + v (q - sg(q)) on the output (Huh et al. eq. 21); 0 = off. */
  double sync_update_v = 0;
  /** The EMA step updates cluster_size and embed_avg but leaves the codes to
   * an explicit update_ema() (the reference's manual_ema_update). */
  bool manual_ema_update = false;
  /** Call update_state() at the end of every training forward. */
  bool update_in_forward = true;
};

/** The batch mean of the codebook-diversity loss: (sum over the batch
 * [N, K] of code probabilities per sequence position, token count [N]) ->
 * mean [N, K]. Differentiable in `sum`. */
using BatchMean = std::function<Tensor(const Tensor& sum, const Tensor& count)>;
/** sum / max(count, 1): the mean over this process's batch. */
Tensor local_batch_mean(const Tensor& sum, const Tensor& count);

class VectorQuantize : public SingleLayerQuantizer, public StepKeyed {
 public:
  /** Keys this layer's per-forward draws by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override {
    sample_gen_.pin(step);
    orthogonal_gen_.pin(step);
    diveq_gen_.pin(step);
  }
  /** Builds the layer; parameters and codes are drawn from `gen`, and the
   * layer's random streams (k-means, dead codes, sampling) are keyed from it. */
  VectorQuantize(const VectorQuantizeOptions& opts, Generator& gen);
  /** Uses `shared` as its codebook (ResidualVQ's shared_codebook): the layer
   * neither owns nor updates it when `update_in_forward` is off. */
  VectorQuantize(const VectorQuantizeOptions& opts, Generator& gen,
                 std::shared_ptr<Codebook> shared);

  /** Quantizes `x` ([B, D], [B, N, D], [B, D, N] or feature maps). `mask`
   * (bool, the token shape [B, N] or [B, H, W]) marks valid tokens: masked
   * ones get zero output, index -1 and contribute nothing to statistics or
   * losses. Indices are [B, N] ([B, N, heads] with several heads). Losses:
   * "commitment", "orthogonal_reg", "codebook_diversity", "inplace_optimize"
   * (unweighted), loss = their weighted sum; 0 in eval mode. Of `opts` only
   * the condition counts: what codebook_transform reads (one layer, no
   * dropout, no temperature). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  /** forward(x, mask, {}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask = Tensor()) {
    return forward(x, mask, QuantizeOptions{});
  }
  /** The reference's forward(x, indices=...): quantizes x (no state update)
   * and returns as loss the cross entropy of the negative distances against
   * `indices` (index -1 is ignored), term "cross_entropy". */
  QuantizeOutput forward_with_indices(const Tensor& x, const Tensor& indices,
                                      const Tensor& mask = Tensor());

  /** The k nearest codes of every token, nearest first (the reference's
   * forward(topk=k); a residual beam search's candidates). One head, inputs
   * [B, N, D] or [B, D] (channel last); k is capped at codebook_size.
   * Returns quantized [B, N, k, D] (routed as forward routes, zeros or the
   * input at masked tokens), indices [B, N, k] (-1 masked) and per-token
   * losses: loss [B, N, k] is the commitment mean((q - x)^2) over the
   * features, weighted (unweighted when the layer has no commitment loss),
   * plus in training the weighted batch terms (orthogonal, diversity); term
   * "commitment" is the unweighted per-token value. Nothing is accumulated:
   * the caller passes the codes it keeps to update_indices. Refused in
   * training with commitment_use_cross_entropy_loss. */
  QuantizeOutput forward_topk(const Tensor& x, int64_t k, const Tensor& mask = Tensor());
  /** In training, accumulates the statistics of `x` (the layer's input
   * layouts) assigned to `indices` (as forward returns them; masked tokens,
   * whose index is -1, count nothing) as a forward would, and with update_in_forward
   * applies them (EMA step, dead-code expiry). A no-op in eval, with a
   * frozen codebook or without EMA and dead-code expiry. */
  void update_indices(const Tensor& x, const Tensor& indices, const Tensor& mask = Tensor());

  /** Codes of `indices` ([..., heads] or [...] with one head; -1 gives zeros)
   * before project_out: [..., heads * codebook_dim] (one layer: no leading
   * quantizers dimension, unlike the stacks), through codebook_transform
   * (no gradient). */
  Tensor get_codes_from_indices(const Tensor& indices) override {
    return codes_from_indices(indices, Tensor());
  }
  /** The same with the condition a conditioned codebook_transform reads:
   * [..., codebook_dim], one row per index (one head). */
  Tensor codes_from_indices(const Tensor& indices, const Tensor& condition);
  /** project_out(get_codes_from_indices(indices)): [..., dim]. */
  Tensor get_output_from_indices(const Tensor& indices) override;

  /** Applies the pending statistics: EMA update then dead-code expiry. */
  void update_state() { codebook_->update_state(); }
  /** The codes from the EMA statistics (with manual_ema_update; the
   * reference's _codebook.update_ema()). */
  void update_ema() { codebook_->update_ema(); }

  Codebook& codebook() { return *codebook_; }
  const Codebook& codebook() const { return *codebook_; }
  const std::shared_ptr<Codebook>& codebook_ptr() const { return codebook_; }
  const VectorQuantizeOptions& options() const { return opts_; }
  /** The resolved defaults. */
  bool uses_rotation_trick() const { return rotation_trick_; }
  bool learnable_codebook() const { return learnable_; }
  bool ema_update() const { return ema_update_; }
  int64_t codebook_dim() const { return codebook_dim_; }
  /** The Codebook's codebooks: heads when separate_codebook_per_head, else 1. */
  int64_t separate_codebooks() const { return opts_.separate_codebook_per_head ? opts_.heads : 1; }
  int64_t codebook_size() const override { return opts_.codebook_size; }
  /** heads: every head gives an index. */
  int64_t num_codebooks() const override { return opts_.heads; }
  bool has_projections() const { return project_in_ != nullptr; }
  /** The codebook-diversity loss's batch mean; a distributed run replaces it
   * with a cross-rank, token-weighted mean (QuantizerSync does), so the loss
   * and its gradient equal one process's on the whole batch. */
  BatchMean batch_mean = local_batch_mean;
  /** Standard normal draws of `shape` for DiVeQ's direction noise: by default
   * from this layer's "vq.diveq" step stream. Replaced to replay another
   * implementation's draws (`quanta parity` does). ResidualVQ's diveq draws
   * from its layer 0's. */
  using NoiseSource = std::function<Tensor(const Shape& shape, const TensorOptions& opts)>;
  NoiseSource directional_noise;
  /** The codebook transform hook (quant/vq/codebook_transform.h): the codes
   * every forward and lookup quantizes with, from the codes (learnable ones
   * with their gradient) and the forward's QuantizeOptions::condition as
   * rows [B * N, codebook_dim]; applied before affine_param's map, which a
   * per-token codebook does not take. Empty: the codes themselves. The
   * constructor sets it to the vq_bridge; ResidualVQ's implicit neural
   * codebook sets its layers' to their MLP. */
  CodebookTransform codebook_transform;

  /** Turns update_in_forward on or off (a distributed wrapper turns it off). */
  void set_update_in_forward(bool on) { opts_.update_in_forward = on; }

 private:
  struct Tokens;
  struct Plan;
  struct Losses;
  Tokens prepare(const Tensor& x, const Tensor& mask);
  // The steps of forward, in order.
  void init_codebook(const Tokens& t);
  Plan plan() const;
  void update_affine(const Tokens& t);
  Tensor codes_for(const Plan& p, const Tensor& condition) const;
  Tensor condition_rows(const Tensor& condition, int64_t rows) const;
  Tensor choose_codes(const Tokens& t, const Tensor& codes, const Tensor& dist, const Plan& p);
  Tensor gathered_codes(const Tensor& idx, const Tensor& codes, const Tensor& dist,
                        const Plan& p) const;
  void accumulate(const Tokens& t, const Tensor& idx);
  Losses losses(const Tokens& t, const Tensor& idx, const Tensor& q, const Tensor& dist,
                const Plan& p);
  Tensor routed_output(const Tensor& x, const Tensor& q, const Tensor& fused, const Plan& p);
  QuantizeOutput finish(const Tokens& t, const Tensor& q_out, const Tensor& idx, const Losses& l);

  Tensor split_heads(const Tensor& t, int64_t b, int64_t n) const;
  Tensor merge_heads(const Tensor& t, int64_t b, int64_t n) const;
  Tensor indices_to_tokens(const Tensor& idx, int64_t b, int64_t n) const;
  Tensor distances(const Tensor& x, const Tensor& codes) const;
  Tensor project_out(const Tensor& t);
  Tensor orthogonal_loss(const Tensor& indices);
  Tensor diversity_loss(const Tensor& dist, const Tensor& valid, int64_t b, int64_t n) const;

  VectorQuantizeOptions opts_;
  int64_t codebook_dim_;
  bool rotation_trick_, learnable_, ema_update_;
  std::shared_ptr<Module> project_in_, project_out_;
  std::shared_ptr<Codebook> codebook_;
  StepStream sample_gen_, orthogonal_gen_, diveq_gen_;
};

}  // namespace quanta::quant
