#pragma once
// BinaryMapper (binary_mapper.py of the reference): `bits` logits per
// position become one of 2^bits codes, sampled bit by bit (Bernoulli of
// sigmoid(logit / temperature)) or thresholded; the output is the code's
// one-hot vector with a straight-through gradient through the factorised
// code probabilities, and an auxiliary loss keeps the bits from becoming
// deterministic too early (their KL to uniform above a threshold).
#include <cmath>
#include <cstdint>
#include <optional>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/step_stream.h"

namespace quanta::quant {

struct BinaryMapperOptions {
  int64_t bits = 1;
  /** The KL (nats) to the uniform code distribution that is free of loss. */
  double kl_loss_threshold = std::log(2.0);
  /** In eval mode, threshold at 1/2 instead of sampling. */
  bool deterministic_on_eval = false;
};

/** Per-call switches; unset ones follow the module's mode as in the reference. */
struct BinaryMapperCall {
  double temperature = 1.0;
  /** Default: training. */
  std::optional<bool> straight_through;
  /** Default: training. */
  std::optional<bool> calc_aux_loss;
  /** Default: deterministic_on_eval and not training. */
  std::optional<bool> deterministic;
  /** Mean the loss over positions (else one value per position). */
  bool reduce_aux_kl_loss = true;
};

class BinaryMapper : public Module, public StepKeyed {
 public:
  /** Keys the sampling stream by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { gen_.pin(step); }
  /** The sampling stream is "binary_mapper.sample" of the next 64 bits of
   * `gen` (draw_seed), as every quantizer family is seeded. */
  BinaryMapper(BinaryMapperOptions opts, Generator& gen);

  /** logits [..., bits] -> quantized = one-hot codes [..., 2^bits] (f32, or
   * the logits' dtype), indices [...] (i64, index = sum_i bit_i 2^i, least
   * significant bit first), loss = mean relu(bits ln 2 - H(bits) - threshold)
   * (term "kl"), 0 when not computed. */
  QuantizeOutput forward(const Tensor& logits, const BinaryMapperCall& call);
  /** forward(logits, {}).quantized. */
  Tensor forward(const Tensor& logits) override;

  int64_t num_codes() const { return int64_t(1) << opts_.bits; }

 private:
  BinaryMapperOptions opts_;
  StepStream gen_;
};

}  // namespace quanta::quant
