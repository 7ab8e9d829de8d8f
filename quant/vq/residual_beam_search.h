#pragma once
// ResidualVQ's beam search (vector-quantize-pytorch's beam_size): instead of
// each layer taking its nearest code greedily, every token keeps the `beam`
// code paths of lowest weighted commitment so far; each layer extends every
// path by its `beam` nearest codes and the best `beam` survive (one after the
// last layer). Lower total error for the same codes, at `beam` times the work.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/tensor.h"
#include "quant/quantize_output.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {

struct BeamSearch {
  /** Paths kept per token (> 1). */
  int64_t beam = 2;
  /** Layer i's commitment counts weights[i] times in a path's score (one
   * per layer). */
  std::vector<double> weights;
  /** residual_quantize's grad_frac. */
  double grad_frac = 0;
};

/** Runs `layers` 0..last_kept (kKeepAllLayers: all) as a beam search over
 * `tokens` [B, N, d] (`keep`: [B, N] bool or undefined). Returns the best
 * path: the summed output [B, N, d], indices [B, N, Q] (-1 for dropped
 * layers and masked tokens), loss [Q] (each layer's per-token loss averaged
 * over the valid tokens; 0 for dropped layers) and the terms stacked per
 * layer likewise. In training each layer then takes the statistics of the
 * path's residuals and codes (VectorQuantize::update_indices). */
QuantizeOutput residual_beam_search(const Tensor& tokens, const Tensor& keep,
                                    const std::vector<std::shared_ptr<VectorQuantize>>& layers,
                                    int64_t last_kept, const BeamSearch& search, bool training);

}  // namespace quanta::quant
