#pragma once
// CorDA's start as PEFT 0.21 computes it (preprocess_corda, then
// init_lora_weights "corda"): the float model reads samples of the training
// data, one forward pass each (batch 1, no padding: PEFT's run_model over a
// calibration set); each adapted layer's inputs X [tokens, in], divided by
// |max(X)|, add X^T X to its covariance, which ends divided by the samples;
// quant::corda_starts decomposes each weight with it, and the residual is
// quantized as PiSSA's is.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "llm/data/lm_examples.h"
#include "llm/model/causal_lm.h"
#include "llm/qlora/qlora_model.h"

namespace quanta::llm {

/** The samples the covariances come from. */
struct CordaData {
  /** Sample i of `samples`: a batch whose first row's first lengths[0]
   * tokens (all of them without lengths) are read, with its position_ids
   * where defined. */
  int64_t samples = 0;
  std::function<LmBatch(int64_t)> sample;
  /** Called after each sample with the count done (progress for a long run). */
  std::function<void(int64_t done, int64_t samples)> on_sample{};
};

/** CordaData over the first `count` of `examples` in file order (all of them
 * when count is 0 or more than there are). `examples` must outlive it.
 * Throws std::invalid_argument for a negative count. */
CordaData corda_samples_in_order(const LmExamples& examples, int64_t count);

/** The input covariance [in, in] (f32, on the model's device) of each layer
 * `layers` names (linear layers, float or NF4), over data's samples, the
 * model in eval mode without gradients; layers reading the same input (q,
 * k and v; gate and up) share one tensor, which is what each would have
 * summed. Throws std::invalid_argument naming the problem for no samples, a
 * name that is not a linear layer, or a layer whose covariance is not
 * finite after a sample (naming the sample: an input with NaN or Inf, or
 * whose largest value was 0, as PEFT refuses); the model is unchanged after a
 * throw too. */
std::vector<Tensor> corda_covariances(CausalLM& model, const std::vector<std::string>& layers,
                                      const CordaData& data);

/** apply_qlora with CorDA's start (options.lora.init_lora_weights corda):
 * the covariances of the layers `options` adapts collected over `data` on
 * the float model, then apply_qlora with them (options.corda_covariances,
 * cleared again after). Throws what apply_qlora and corda_covariances
 * throw, before anything is converted where apply_qlora refuses the
 * settings (a 4-bit folder's model among them: no float weights). */
QLoRAReport apply_qlora_corda(CausalLM& model, QLoRAOptions& options, const CordaData& data);

}  // namespace quanta::llm
