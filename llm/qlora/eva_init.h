#pragma once
// EVA (Explained Variance Adaptation; Paischer et al. 2024) as PEFT 0.21's
// initialize_lora_eva_weights computes it: the base model (adapters off)
// reads training batches; each adapted layer's inputs at the scored
// positions feed an incremental PCA (engine/ops/incremental_pca.h; layers
// reading the same input, as q/k/v and gate/up do, share one) until the
// components a layer needs agree with the batch before's (cosine >= tau);
// the total rank (the layers' r summed) goes to the components of largest
// explained variance among all layers, at most round(r x rho) a layer, so
// some layers get more than r, some less, some none; each A is its layer's
// top components, B zero.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "llm/data/lm_examples.h"
#include "llm/model/causal_lm.h"
#include "llm/qlora/lora_config.h"
#include "llm/qlora/qlora_model.h"

namespace quanta::llm {

/** The batches EVA reads, and how. */
struct EvaData {
  /** Batch i of `batches`, read in a cycle (0, 1, ..., batches - 1, 0, ...)
   * until every layer has converged: the fine-tune's examples in file order
   * (PEFT's dataloader). Its ids go through CausalLM::hidden_states with its
   * position_ids; LmBatch::lengths tells the padding. */
  int64_t batches = 0;
  std::function<LmBatch(int64_t)> batch;
  /** Each update's SVD: torch.svd_lowrank's with this many power iterations
   * (PEFT's EVA: 4, q twice the components), each input's one sketch from a
   * stream of `seed` named after its first layer (IncrementalPCA); -1: the
   * exact SVD (for small models and tests). */
  int64_t svd_niter = 4;
  uint64_t seed = 0;
  /** Forward passes (the first, which finds the shared inputs, included)
   * after which a layer that has not converged is an error naming it, not a
   * loop without end (PEFT cycles for ever). */
  int64_t max_forwards = 1000;
  /** Called after each forward pass with its count, the inputs converged
   * and the inputs in all (progress for a long run). */
  std::function<void(int64_t forwards, int64_t converged, int64_t inputs)> on_forward{};
};

/** EvaData over `examples` in file order, `rows` a batch (the last may be
 * shorter): PEFT's dataloader without shuffling. `examples` must outlive
 * it; the other fields keep their defaults. */
EvaData eva_batches_in_order(const LmExamples& examples, int64_t rows);

/** A layer EVA starts: its name and the r and lora_alpha it was given. */
struct EvaTarget {
  std::string name;
  int64_t r = 0;
  double lora_alpha = 0;
};

/** One layer's start. */
struct EvaLayer {
  std::string name;
  /** Its rank after the redistribution (0: no adapter) and lora_alpha
   * (times r / the given r with adjust_scaling_factors). */
  int64_t r = 0;
  double lora_alpha = 0;
  /** The layer whose input it reads too (the first in model order), or "". */
  std::string input_of;
  /** [r, in] (f64, on the host): the top r components (whitened with
   * whiten); undefined for r 0. */
  Tensor lora_A;
};

struct EvaStarts {
  /** In the order of the targets. */
  std::vector<EvaLayer> layers;
  /** Forward passes run (the first, which finds the shared inputs,
   * included) and the positions the passes after it took inputs at. */
  int64_t forwards = 0;
  int64_t positions = 0;
};

/** EVA over `model`, whose layers `targets` name are linear modules taking
 * one input (float or NF4; their outputs are not changed), in eval mode
 * without gradients. Layers reading equal inputs on the first batch share
 * one decomposition (PEFT hashes them). A batch whose scored positions are
 * fewer than a layer's components leaves its fit as it is (PEFT skips it
 * too). Throws std::invalid_argument naming the problem for no batches, a
 * target the model does not have, a layer allowed more components than its
 * inputs have features, r < 1, or layers not converged after
 * data.max_forwards passes (naming them, their batches and tau); the model
 * is unchanged (its layers back in place) after a throw too. */
EvaStarts eva_starts(CausalLM& model, const std::vector<EvaTarget>& targets,
                     const EvaConfig& config, const EvaData& data);

/** apply_qlora with EVA's start (options.lora.init_lora_weights eva): the
 * base quantized to NF4 first (a 4-bit folder's as loaded), eva_starts over
 * `data` with the layers, ranks and alphas `options` chooses, then
 * apply_qlora with their lora_A's and `options.lora` rewritten as PEFT's
 * _load_eva_state_dict leaves its config: target_modules the layers with a
 * rank (full names in model order; 20 or more shortened to the suffixes
 * that name them and no other module, minimal_target_modules; the layer
 * choice's other fields, now spent, cleared), rank_pattern and alpha_pattern the layers whose rank
 * or alpha differ from r and lora_alpha. The report's totals are the float model's. Throws what
 * apply_qlora and eva_starts throw, before anything is converted where apply_qlora refuses the
 * settings. */
QLoRAReport apply_qlora_eva(CausalLM& model, QLoRAOptions& options, const EvaData& data,
                            EvaStarts* starts = nullptr);

}  // namespace quanta::llm
