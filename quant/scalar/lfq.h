#pragma once
// LFQ: lookup-free quantization (MAGVIT-v2). Each of d = log2(codebook_size)
// code dimensions becomes +-codebook_scale by its sign, so the index is the
// bit pattern (first dim most significant). Training adds an entropy loss
// (confident per token, diverse over the batch) and optionally a commitment
// loss. spherical = true is BSQ: inputs and codes l2-normalised. Behaviour
// follows vector-quantize-pytorch 1.31.0; see lfq_entropy.h for how the
// entropy terms avoid the reference's T x 2^d distance matrix.
#include <cstdint>
#include <memory>
#include <optional>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/scalar/lfq_entropy.h"
#include "quant/step_stream.h"

namespace quanta::quant {

/** How LFQ computes its entropy terms. */
enum class LFQEntropyPath {
  /** factorised (exact for every setting, including frac_per_sample_entropy < 1). */
  automatic,
  /** per-bit walk + blocked GEMM (lfq_entropy.h). */
  factorised,
  /** the reference's softmax over all 2^d codes: memory T x 2^d. */
  direct,
};

/** LFQ settings; names and defaults are the reference's. */
struct LFQOptions {
  /** Input features; 0 = codebook_dim * num_codebooks. */
  int64_t dim = 0;
  /** A power of two; 0 = 2^dim. */
  int64_t codebook_size = 0;
  double entropy_loss_weight = 0.1;
  double commitment_loss_weight = 0.0;
  /** Weight of the batch entropy inside the entropy loss. */
  double diversity_gamma = 1.0;
  int64_t num_codebooks = 1;
  /** Keep a trailing codebook dim in the indices; default num_codebooks > 1. */
  std::optional<bool> keep_num_codebooks_dim;
  /** The code values are +-codebook_scale. */
  double codebook_scale = 1.0;
  /** Fraction of (unmasked) tokens, drawn at random from the stream
   * "lfq.entropy_tokens", that both entropy terms use; 1 = all. */
  double frac_per_sample_entropy = 1.0;
  /** Default: dim != codebook_dim * num_codebooks. */
  std::optional<bool> has_projections;
  bool projection_has_bias = true;
  /** > 0: inputs pass through tanh(x / v) v after project_in. */
  double soft_clamp_input_value = 0.0;
  /** Inputs of rank 3 are [B, D, N] (rank >= 4 inputs are always channel first). */
  bool channel_first = false;
  /** BSQ: l2-normalise inputs and codes (times codebook_scale). */
  bool spherical = false;
  /** forward's default inverse temperature of the code distributions. */
  double inv_temperature = 100.0;
  LFQEntropyPath entropy_path = LFQEntropyPath::automatic;
};

class LFQ : public SingleLayerQuantizer, public StepKeyed {
 public:
  /** Keys this layer's per-forward draws by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { sample_gen_.pin(step); }
  /** Builds the layer seeded with the next 64 bits of `gen` (draw_seed), as
   * every quantizer family is: that seed keys the projections'
   * initialisation and the token sampling stream. */
  LFQ(LFQOptions opts, Generator& gen);

  /** Quantizes x (layouts as FSQ). `mask` (bool, [B, N] or the input's
   * spatial shape; true = keep) restricts the losses to the kept tokens.
   * loss = entropy_loss_weight (per_sample - diversity_gamma batch) +
   * commitment_loss_weight commitment in train mode, 0 in eval; terms
   * "per_sample_entropy", "batch_entropy", "commitment". Indices int64.
   * opts.inv_temperature <= 0 uses the option; opts.last_kept changes nothing. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  /** forward(x, mask, {.inv_temperature = inv_temperature}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, double inv_temperature = 0) {
    return forward(x, mask, QuantizeOptions{.inv_temperature = inv_temperature});
  }
  Tensor forward(const Tensor& x) override;

  /** Indices (as forward returns them) to codes [..., num_codebooks * d],
   * then project_out when asked; image / channel-first layouts get features at
   * dim 1. */
  Tensor indices_to_codes(const Tensor& indices, bool project_out = true) const;
  /** Codes [..., C * d], channel-last, before project_out. */
  Tensor indices_to_grid_codes(const Tensor& indices) const;
  /** indices_to_grid_codes. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** What forward outputs for `indices`, channel-last: the codes then
   * project_out, [..., dim]. */
  Tensor get_output_from_indices(const Tensor& indices) override;
  /** The code table before spherical normalisation: [codebook_size, d] of
   * +-codebook_scale. */
  Tensor codebook() const;

  /** The batch mean of code distributions; replace it to average across
   * processes (see TokenMean). */
  TokenMean token_mean = local_token_mean;

  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return opts_.num_codebooks; }
  int64_t codebook_dim() const { return bits_; }
  int64_t dim() const { return dim_; }
  bool has_projections() const { return project_in_ != nullptr; }
  bool keep_num_codebooks_dim() const { return keep_codebook_dim_; }
  const LFQOptions& options() const { return opts_; }

 private:
  /** +-m per bit of every code: what the entropy terms compare against. */
  Tensor entropy_codebook(const Tensor& like) const;

  LFQOptions opts_;
  uint64_t seed_;
  int64_t dim_ = 0, bits_ = 0, codebook_size_ = 0;
  bool keep_codebook_dim_ = false;
  std::shared_ptr<Linear> project_in_, project_out_;
  Tensor bit_mask_;  // "mask": 2^(d-1) ... 1, the reference's buffer
  StepStream sample_gen_;
};

}  // namespace quanta::quant
