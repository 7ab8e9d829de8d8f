#pragma once
// Quantize dropout (SoundStream, Encodec): in training a residual stack keeps
// only its layers 0..k, for a k drawn per forward, so the first layers learn
// to stand alone. One rule for every residual family, vector-quantize-
// pytorch's: it applies to every training forward (grad on or off), k is
// uniform in [cutoff_index, Q - 1], then rounded up so that k + 1 is a
// multiple of `multiple_of` (structured dropout, Encodec uses 4).
#include <cstdint>
#include <string>

#include "engine/random/generator.h"

namespace quanta::quant {

/** The quantize-dropout options of a residual stack (the reference's
 * quantize_dropout, quantize_dropout_cutoff_index, quantize_dropout_multiple_of). */
struct QuantizeDropout {
  bool enabled = false;
  int64_t cutoff_index = 0;
  int64_t multiple_of = 1;

  /** Throws std::invalid_argument naming `who` unless multiple_of >= 1 and
   * cutoff_index lies in [0, num_layers) (the reference's randrange would
   * fail on the first training forward otherwise). */
  void check(const std::string& who, int64_t num_layers) const;
  /** Whether a forward of a stack of `num_layers` drops layers: enabled,
   * training, and more than one layer. */
  bool applies(bool training, int64_t num_layers) const {
    return enabled && training && num_layers > 1;
  }
  /** The last layer kept: k as above, drawn from `gen`, capped at
   * num_layers - 1 (rounding up past the last layer keeps them all). */
  int64_t draw(Generator& gen, int64_t num_layers) const;
};

/** Passed as `last_kept`: keep every layer. */
inline constexpr int64_t kKeepAllLayers = -1;

}  // namespace quanta::quant
