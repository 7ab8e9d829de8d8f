#pragma once
// What every quantizer's forward returns, so training code, the `quanta`
// command and the parity runner treat VQ, FSQ and LFQ families alike.
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace quanta::quant {

/** Named loss terms in a fixed order ("commitment", "orthogonal_reg", ...):
 * the reference's `return_loss_breakdown` terms, unweighted. */
using LossTerms = std::vector<std::pair<std::string, Tensor>>;

/** The result of a quantizer's forward pass. */
struct QuantizeOutput {
  /** The quantized input, in the input's layout (channel-last tokens, channel-
   * first sequences or image feature maps) and dtype. Differentiable w.r.t.
   * the input in train mode (straight-through or rotation trick). */
  Tensor quantized;
  /** Code indices (int64, or int32 where the reference returns int32), in the
   * input's token layout: [B, N], [B, H, W], with a trailing heads /
   * quantizers / codebooks dimension where the layer has several. */
  Tensor indices;
  /** The auxiliary loss exactly as the reference returns it: a scalar for
   * single-layer quantizers (already weighted), [num_quantizers] for residual
   * ones, [groups, num_quantizers] for grouped ones. Zero (never NaN) for an
   * empty or fully masked batch. */
  Tensor loss;
  /** Unweighted loss terms by name (the reference's loss breakdown). */
  LossTerms losses;

  /** The loss term `name`; throws std::out_of_range naming it when absent. */
  const Tensor& term(const std::string& name) const {
    for (const auto& [n, t] : losses)
      if (n == name) return t;
    throw std::out_of_range("QuantizeOutput: no loss term '" + name + "'");
  }
};

}  // namespace quanta::quant
