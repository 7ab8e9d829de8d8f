#pragma once
// QLoRA on a CausalLM, as transformers + bitsandbytes + PEFT build it: every
// linear layer but lm_head becomes a frozen NF4 weight quantized exactly as
// bitsandbytes' Linear4bit does (same packed codes and scales, its layout),
// and the layers target_modules names get LoRA adapters (PEFT's
// initialisation, drawn from quanta's named streams). Embeddings, norms and
// lm_head stay in the model's dtype and, like the bases, are frozen: the
// adapters are the only trainable tensors.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/io/safetensors.h"
#include "engine/nn/module.h"
#include "llm/model/causal_lm.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/lora_config.h"
#include "quant/nf4/loftq.h"
#include "quant/nf4/nf4_modules.h"
#include "quant/nf4/residual_init.h"

namespace quanta::llm {

/** A trainable tokens' parameter under its module, as PEFT names it too
 * ("model.embed_tokens." + this). */
inline constexpr const char* kTokenAdapterParameter = "token_adapter.trainable_tokens_delta";

/** A QLoRA model's settings. */
struct QLoRAOptions {
  LoraSettings lora;
  BaseQuantization quantization;
  /** Seed of the adapters' initialisation and dropout streams (each layer
   * draws from its own, named after it). */
  uint64_t seed = 0;
  /** Refuse settings that choose nothing (unused_lora_settings' `others`:
   * an exclude_modules entry, layers_to_transform index or rank_pattern key
   * without effect). Off to read an adapter folder as PEFT reads it. */
  bool refuse_unused_settings = true;
  /** Refuse a target_modules entry that matches no linear layer. Off for
   * an image-text model's adapter folder, whose entries may name only its
   * vision tower's layers (fc1, out_proj), which quanta does not load. */
  bool refuse_unmatched_targets = true;
  /** With init_lora_weights pissa, olora or corda: each adapted layer's start (A0,
   * B0) by layer name, as a folder saved it, taken out of the base instead of
   * decomposing the weight again (apply_peft_adapters). */
  std::map<std::string, std::pair<Tensor, Tensor>> stored_starts{};
  /** Each named layer's lora_A [r, in] (any float dtype and device; B stays
   * as drawn): EVA's start (apply_qlora_eva). A name that is not an adapted
   * layer, or a shape other than its adapter's, is refused. */
  std::map<std::string, Tensor> given_lora_A{};
  /** With init_lora_weights corda: each adapted layer's input covariance
   * [in, in] by layer name (llm::corda_covariances; any float dtype and
   * device). An adapted layer without one is refused, unless stored_starts
   * gives its start. */
  std::map<std::string, Tensor> corda_covariances{};
  /** Called with each decoder layer's name ("model.layers.3"), in model
   * order, as soon as its linear layers hold their final 4-bit bases
   * (LoftQ's corrections included) and adapters: for a loader that shards
   * each layer as it is made (dist::ShardedUnits::shard), so that a rank
   * never holds the whole base. */
  std::function<void(const std::string& layer)> on_layer_converted{};
};

/** One converted linear layer. */
struct QLoRALayer {
  std::string name;  // "model.layers.0.self_attn.q_proj"
  Shape shape;       // [out, in]
  bool adapted = false;
  std::size_t bytes_before = 0;  // the float weight
  std::size_t bytes_after = 0;   // codes and scales in bitsandbytes' layout
  /** With init_lora_weights loftq, and pissa, olora or corda over float weights:
   * the squared Frobenius norm of the layer's quantization error before and
   * after the start (LoftQ's correction; PiSSA's, OLoRA's and CorDA's quantized
   * residual plus their adapters). */
  std::optional<quant::QuantizationErrorChange> quantization_error{};
};

/** What apply_qlora did. */
struct QLoRAReport {
  std::vector<QLoRALayer> layers;
  /** The modules trained whole (modules_to_save), by full name. */
  std::vector<std::string> saved_modules;
  int64_t trainable_parameters = 0;
  int64_t total_parameters = 0;  // of the float model
  /** apply_peft_adapters over an image-text model: the folder's tensors
   * adapting its vision tower or projector, left out (quanta reads text,
   * which they do not change). */
  int64_t vision_tensors_left_out = 0;
};

/** Converts `model` in place (see the top of this file), each adapter with
 * the r and alpha lora_layer_settings gives its layer; the parameters of
 * the modules modules_to_save names, the biases lora.bias names
 * (trained_biases) and the token rows trainable_token_indices names
 * (CausalLM::add_trainable_tokens) train too. Throws
 * std::invalid_argument naming the problem for a target_modules entry that
 * matches no linear layer, settings that adapt no layer, an unused setting
 * (refuse_unused_settings; a bias setting that trains no bias among them),
 * trainable tokens CausalLM::add_trainable_tokens or PEFT refuses (and a
 * module named by modules_to_save too),
 * a layer's r above its in or out features, a
 * modules_to_save entry matching no module or naming a linear layer other
 * than lm_head, a container, or a tied model's embeddings, init_lora_weights
 * loftq, pissa or corda over a base loaded in 4 bits (no float weights to
 * correct toward or decompose), corda without an adapted layer's
 * covariance, or a model already converted; the model is then
 * unchanged. LoftQ computes each adapted layer's SVD on the host
 * (quant::loftq_init), one layer per core: in f32 0.35 s for 768 x 2048,
 * 7.1 s for 2048 x 5632 and 66 s for 4096 x 11008 on one EPYC core; PiSSA
 * the same SVD of the weight (far less with pissa_niter), OLoRA a QR,
 * CorDA an inverse and an SVD of W C in f64 (quant::corda_starts). Their
 * adapters keep the start (LoRALinear::set_initial_adapters), which the
 * base holds taken out: PiSSA quantizes the float weight's residual, rounded
 * to the model's dtype first (what PEFT's recipe saves and bitsandbytes then
 * loads; CorDA's alike); OLoRA, as PEFT over a bitsandbytes model, takes its QR of the
 * base as quantized (dequantized to the model's dtype) and quantizes the f32
 * residual again, from a 4-bit folder too. */
QLoRAReport apply_qlora(CausalLM& model, const QLoRAOptions& options);

/** apply_qlora's NF4 conversion without adapters: the 4-bit base alone, as
 * transformers' load_in_4bit builds it (every parameter frozen). Throws
 * std::invalid_argument for a model already converted. */
QLoRAReport quantize_base(CausalLM& model, const BaseQuantization& quantization);

/** The adapted layers of a converted model, by module name, in model order. */
std::vector<std::pair<std::string, quant::LoRALinear*>> lora_layers(Module& model);

/** The biases `which` trains in a converted model, in model order, under
 * the names PEFT gives them without its "base_model.model." prefix: an
 * adapted layer's "<layer>.base_layer.bias" (lora_only: those alone), any
 * other "<module>.bias" (all). */
std::vector<std::pair<std::string, Tensor>> trained_biases(Module& model, TrainedBiases which);

/** What apply_qlora(model, options) would train, as the names
 * trained_biases and PEFT use without "base_model.model."
 * ("<layer>.lora_A.weight", "<layer>.base_layer.bias", "lm_head.weight")
 * and shapes, found without changing the model: an adapter file can be
 * checked against it before the model is converted. Throws what apply_qlora
 * throws. */
std::vector<std::pair<std::string, Shape>> planned_trained_tensors(CausalLM& model,
                                                                   const QLoRAOptions& options);

/** The NF4 layers of a converted model (adapted or not), by module name, in
 * model order. */
std::vector<std::pair<std::string, quant::NF4Linear*>> nf4_layers(Module& model);

/** The NF4 bases of a converted model as bitsandbytes serializes them, under
 * the module names transformers uses ("model.layers.0.mlp.up_proj.weight",
 * ".weight.absmax", ".weight.quant_map", ".weight.nested_absmax",
 * ".weight.nested_quant_map", ".weight.quant_state.bitsandbytes__nf4"), plus
 * their biases: what a 4-bit transformers checkpoint holds for them. */
io::TensorMap bnb_base_tensors(Module& model);

/** Replaces the NF4 bases of a converted model by the bitsandbytes states
 * `tensors` holds under those names (read_bnb_tensors): a base quantized by
 * bitsandbytes, bit for bit. Every base must be there with the layer's
 * shape and the model's block size and double quantization; the error names
 * `source` and every problem, and the model is unchanged then. */
void load_bnb_base(Module& model, const std::map<std::string, Tensor>& tensors,
                   const std::string& source);

/** Writes the trainable tokens into their layers and replaces every adapted
 * layer by a plain Linear holding its merged weight (base dequantized +
 * scaling B A) and bias (LoRALinear::merged_bias) and
 * every other NF4 layer by its dequantized weight, in the model's dtype:
 * the model a merged fine-tune saves with save_causal_lm. Throws
 * std::invalid_argument naming the layer for lora_bias over a layer without
 * a bias, before anything is replaced. */
void merge_qlora(CausalLM& model);

/** Writes to `dir` the folder merge_qlora then save_causal_lm(model, dir,
 * beside) would write (the same files, byte for byte), a layer at a time:
 * each merged (or dequantized) weight is made on the model's device when its
 * turn in the file comes, copied to the host, written and let go, so that
 * neither the device nor the host holds the float model (peak: the converted
 * model as it is plus two float layers). The model keeps its adapters and
 * 4-bit bases; its trainable tokens are written into their layers first, as
 * merge_qlora writes them. Sharded as `options` says, in the merged model's
 * order. Refuses what merge_qlora refuses before writing; on an error
 * `dir`'s weights and config are as they were (write_model_weights).
 *
 * Given `float_base` (a layer's weight by its model name,
 * "model.layers.0.mlp.up_proj.weight": the float weight its base was
 * quantized from), the merge is PEFT's over the float model instead: each
 * adapted layer's weight is LoRALinear::merged_weight(float_base(name)), and
 * each other NF4 layer keeps its float weight. That is not the model the
 * adapters were trained in (its base was NF4), and for adapters fitted to
 * the quantization error (LoftQ) it is wrong. */
void save_merged_causal_lm(CausalLM& model, const std::string& dir, const StateDict& beside = {},
                           const SaveOptions& options = {},
                           const std::function<Tensor(const std::string&)>& float_base = {});

/** merge_qlora's check alone: throws std::invalid_argument naming the first
 * adapted layer with lora_bias whose base has no bias. */
void check_qlora_mergeable(Module& model);

}  // namespace quanta::llm
