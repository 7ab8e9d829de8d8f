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
  /** PEFT's covariance_file, as safetensors (save_corda_covariances): where
   * it exists, apply_qlora_corda reads the covariances from it instead of
   * the samples (another rank or alpha over the same data needs no pass);
   * else it writes them there after the pass, when write_covariance_file. */
  std::string covariance_file{};
  bool write_covariance_file = true;
};

/** Writes `covariances` (corda_covariances' for `layers`) to `path`
 * atomically as safetensors: one f32 tensor per distinct input, under the
 * first layer reading it, and in the metadata the format
 * ("quanta.corda_covariances"), the samples and the layers reading another's
 * input ("same_input": JSON, layer to first layer). */
void save_corda_covariances(const std::string& path, const std::vector<std::string>& layers,
                            const std::vector<Tensor>& covariances, int64_t samples);

/** The covariances of `layers` from such a file, on `device` (layers that
 * share an input share the tensor), and in *samples the samples they came
 * from. Throws std::invalid_argument naming the file for another format, or
 * a layer it holds no covariance for. */
std::vector<Tensor> load_corda_covariances(const std::string& path,
                                           const std::vector<std::string>& layers, Device device,
                                           int64_t* samples = nullptr);

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
 * throw too. The passes run the float model, so weights it left in its files
 * (LoadOptions::defer_layer_weights) are read first, onto its device. */
std::vector<Tensor> corda_covariances(CausalLM& model, const std::vector<std::string>& layers,
                                      const CordaData& data);

/** apply_qlora with CorDA's start (options.lora.init_lora_weights corda):
 * the covariances of the layers `options` adapts collected over `data` on
 * the float model (or read from data.covariance_file), then apply_qlora
 * with them (options.corda_covariances, cleared again after). Throws what
 * apply_qlora, corda_covariances and load_corda_covariances throw, a
 * covariance file's tensor of another shape than its layer's [in, in]
 * (naming both), before anything is converted where apply_qlora refuses the
 * settings (a 4-bit folder's model among them: no float weights). */
QLoRAReport apply_qlora_corda(CausalLM& model, QLoRAOptions& options, const CordaData& data);

}  // namespace quanta::llm
