#pragma once
// What every quantizer offers: the single layers (VectorQuantize, SimVQ,
// FSQ, LFQ, LatentQuantize), the residual stacks (ResidualVQ, ResidualSimVQ,
// ResidualFSQ, ResidualLFQ) and their grouped forms. The residual stack and
// the grouped wrapper are written once over it (quant/residual.h,
// quant/grouped.h) and callers such as the `quanta` command drive any family
// the same way, including with a quantize-dropout decision of their own.
// Codebook state for QuantizerSync stays where it lives (Codebook, LFQ's
// token means, StepKeyed streams): QuantizerSync finds it by walking the
// module tree, whatever the family.
#include <cstdint>
#include <optional>

#include "engine/nn/module.h"
#include "engine/tensor.h"
#include "quant/quantize_dropout.h"
#include "quant/quantize_output.h"

namespace quanta::quant {

/** What a caller may tell one forward besides the input and the mask. */
struct QuantizeOptions {
  /** Quantize dropout's last kept layer (kKeepAllLayers: keep every one);
   * unset: the quantizer decides (QuantizeDropout's rule, its own stream). */
  std::optional<int64_t> last_kept = std::nullopt;
  /** LFQ's inverse temperature of the code distribution (0: the layer's
   * option); the other families ignore it. */
  double inv_temperature = 0;
  /** What a VectorQuantize layer's conditioned codebook transform reads:
   * tokens [B, N, d] like the layer's (ResidualVQ's implicit neural codebook
   * passes the sum of the earlier layers' outputs); undefined: none. The
   * other families ignore it. */
  Tensor condition = Tensor();
};

class Quantizer : public Module {
 public:
  using Module::Module;

  /** Quantizes `x` (the layer's input layouts) where the bool `mask` (token
   * shape; undefined: every token) is set. Indices end in a quantizers
   * dimension (-1 for dropped layers and masked tokens); loss and loss terms
   * as the family reports them. A single layer (SingleLayerQuantizer) has no
   * quantizers dimension: its indices are the reference's, [B, N...] or
   * [B, N..., heads / codebooks]. */
  virtual QuantizeOutput forward(const Tensor& x, const Tensor& mask,
                                 const QuantizeOptions& opts) = 0;
  /** Per-layer codes [Q, ..., d] of indices [..., q] (q <= Q; missing
   * layers and -1 give zeros); grouped: [G, Q, ..., d] of [G, ..., q]; a
   * single layer: its codes [..., d] of indices as its forward returns them,
   * before project_out (no Q dimension). */
  virtual Tensor get_codes_from_indices(const Tensor& indices) = 0;
  /** What forward outputs for `indices`, channel-last: [..., dim]. */
  virtual Tensor get_output_from_indices(const Tensor& indices) = 0;
  /** Layers per stack (Q). */
  virtual int64_t num_quantizers() const = 0;
  /** Codes per codebook (a stack's: its largest layer's). */
  virtual int64_t codebook_size() const = 0;
  /** Indices a forward gives each token (the trailing dimension, or 1 where
   * there is none): a single layer's heads or codebooks, a stack's layers,
   * a grouped form's groups x layers. */
  virtual int64_t num_codebooks() const = 0;
  /** The last layer the next forward keeps when the caller does not say:
   * drawn (advancing the dropout stream) when quantize dropout applies,
   * kKeepAllLayers otherwise. */
  virtual int64_t dropout_decision() = 0;
};

/** Base of the single-layer quantizers: one layer, nothing to drop, so
 * QuantizeOptions::last_kept changes nothing. */
class SingleLayerQuantizer : public Quantizer {
 public:
  using Quantizer::Quantizer;

  int64_t num_quantizers() const final { return 1; }
  int64_t dropout_decision() final { return kKeepAllLayers; }
};

}  // namespace quanta::quant
