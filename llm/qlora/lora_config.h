#pragma once
// What a QLoRA fine-tune is: PEFT's LoraConfig fields (r, lora_alpha,
// lora_dropout, target_modules, use_rslora, use_dora, bias, lora_bias,
// modules_to_save, trainable_token_indices, and the ones choosing layers and their ranks:
// exclude_modules, layers_to_transform, layers_pattern, rank_pattern,
// alpha_pattern) and bitsandbytes' 4-bit settings (NF4, block 64, double
// quantization, compute dtype), with PEFT's adapter_config.json as their
// file form.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "quant/nf4/corda_start.h"

namespace quanta::llm {

/** PEFT's target_modules value that selects every linear layer but the
 * output projection. */
inline constexpr const char* kAllLinear = "all-linear";

/** PEFT's `bias`: which of the base model's biases train beside the
 * adapters (and are saved with them): none, every bias of the model, or
 * those of the adapted layers. */
enum class TrainedBiases { none, all, lora_only };

/** PEFT's spelling: "none", "all", "lora_only". */
const char* trained_biases_name(TrainedBiases b);
/** The inverse; throws std::invalid_argument naming the three values. */
TrainedBiases parse_trained_biases(const std::string& text);

/** How the adapters start (PEFT's init_lora_weights). */
enum class LoraInit {
  /** A Kaiming-uniform, B zero: PEFT's default, true. */
  kaiming_uniform,
  /** A normal with std 1 / r, B zero: "gaussian". */
  gaussian,
  /** A and B both random (nn.Linear's initialisation): false. The model
   * changes from the first step; for tests. */
  both_random,
  /** LoftQ's: B A the best rank-r correction of each layer's quantization
   * error (quant::loftq_init), from the float weights the base is quantized
   * from; PEFT's replace_lora_weights_loftq. */
  loftq,
  /** PiSSA's: B A the weight's r principal singular triplets and the base
   * the residual, quantized (quant::pissa_starts; PEFT's "pissa", or
   * "pissa_niter_N" with LoraSettings::pissa_niter). Needs the float
   * weights. */
  pissa,
  /** OLoRA's: B A the leading columns of the weight's QR, taken out of the
   * base as it was quantized and the residual quantized again
   * (quant::olora_starts; PEFT's "olora" over a bitsandbytes model). */
  olora,
  /** Random factors whose product is zero (quant::LoRAInit::orthogonal;
   * PEFT's "orthogonal"); an even r. */
  orthogonal,
  /** EVA's (Explained Variance Adaptation): A the top principal components
   * of each adapted layer's inputs over training batches, B zero, and the
   * ranks redistributed among the layers by explained variance
   * (llm::apply_qlora_eva; PEFT's "eva" with initialize_lora_eva_weights).
   * apply_qlora alone starts such adapters as true does, as PEFT's model
   * does before the data is seen. */
  eva,
  /** CorDA's (Context-Oriented Decomposition Adaptation): B A the singular
   * triplets of W C (C the covariance of the layer's inputs over samples of
   * the training data) that CordaConfig::method chooses, and the base the
   * residual, quantized (quant::corda_starts; PEFT's "corda" after
   * preprocess_corda). Needs the float weights and the covariances
   * (llm::apply_qlora_corda collects them). */
  corda,
};

/** EVA's settings, PEFT's EvaConfig: each layer may take up to round(r x
 * rho) ranks (rho >= 1; 1 keeps every layer's r); a component has converged
 * when its cosine similarity to the one of the batch before is >= tau (in [0,
 * 1]); with use_label_mask, the positions labelled label_mask_value are left
 * out; whiten divides each component by the square root of its singular
 * value; adjust_scaling_factors multiplies a layer's lora_alpha by its new
 * rank over its r, keeping alpha / r. */
struct EvaConfig {
  double rho = 2.0;
  double tau = 0.99;
  bool use_label_mask = true;
  int64_t label_mask_value = -100;
  bool whiten = false;
  bool adjust_scaling_factors = true;
};

/** CorDA's settings, PEFT's CordaConfig: which triplets the adapters take
 * (corda_method). PEFT's cache and covariance files are torch pickles:
 * quanta collects the covariances from the data each time. */
struct CordaConfig {
  quant::CordaMethod method = quant::CordaMethod::ipm;
};

/** PEFT's spelling of a kind: "true", "gaussian", "false", "loftq",
 * "pissa", "olora", "orthogonal", "eva", "corda". */
const char* lora_init_name(LoraInit init);

/** LoRA adapters as PEFT's LoraConfig describes them. Which layers get one
 * and with which r and alpha is PEFT's rule (lora_targets.h). Regular
 * expressions are Python's as far as ECMAScript (std::regex) shares them:
 * lookbehind, named groups and inline flags are refused. */
struct LoraSettings {
  /** The rank and alpha of layers no rank_pattern / alpha_pattern key matches. */
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0;
  /** Module-name suffixes ("q_proj" matches "model.layers.0.self_attn.q_proj")
   * or full names, or the one entry "all-linear". Empty when
   * target_modules_regex chooses. */
  std::vector<std::string> target_modules = {kAllLinear};
  /** PEFT's target_modules given as one string: a regular expression a
   * layer's full name must match entirely ("model\.layers\.\d+\.self_attn\..*"). */
  std::string target_modules_regex;
  /** Layers never adapted, by suffix or full name (as target_modules). */
  std::vector<std::string> exclude_modules;
  /** ... or by a regular expression matching the full name entirely. */
  std::string exclude_modules_regex;
  /** With a target_modules list: only layers of these indexes (the number
   * after layers_pattern, else the first "<name>.<number>." of the name).
   * Empty: every layer. */
  std::vector<int64_t> layers_to_transform;
  /** The name the layer index follows ("layers"; a regular expression). */
  std::vector<std::string> layers_pattern;
  /** Per-layer r and lora_alpha: the first key (a regular expression) that
   * matches the end of a layer's name after a dot, in this order, gives its
   * value ("q_proj", "layers\.0\..*"). */
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  /** alpha / sqrt(r) instead of alpha / r. */
  bool use_rslora = false;
  /** DoRA: a trained magnitude per output row of each adapted layer
   * (quant::LoRALinear), saved as "<layer>.lora_magnitude_vector". */
  bool use_dora = false;
  /** The base biases that train (PEFT's bias), saved under PEFT's names:
   * "<layer>.base_layer.bias" for an adapted layer, "<layer>.bias" for
   * another. Not decayed by AdamW (transformers' Trainer leaves biases out). */
  TrainedBiases bias = TrainedBiases::none;
  /** A trainable bias on each adapter's second factor (PEFT's lora_bias,
   * "<layer>.lora_B.bias"), scaled with its product; not with DoRA. */
  bool lora_bias = false;
  /** Token rows trained beside the adapters (PEFT's trainable_token_indices,
   * llm::TrainableTokens), by module: "embed_tokens" or "lm_head" (a name
   * suffix), or "" for the input embeddings (PEFT's list form). A tied
   * model's output layer takes the embeddings' rows. */
  std::vector<std::pair<std::string, std::vector<int64_t>>> trainable_token_indices;
  /** Modules trained whole beside the adapters and saved with them (PEFT's
   * modules_to_save): those whose full name ends with an entry
   * ("embed_tokens", "lm_head"); never an NF4 layer, and not the embeddings
   * or output layer of a tied model. */
  std::vector<std::string> modules_to_save;
  /** How the adapters start; adapter_config.json records it as PEFT does
   * (true for loftq, as replace_lora_weights_loftq leaves the config), and
   * a folder read back starts from its stored adapters whatever it says. */
  LoraInit init_lora_weights = LoraInit::kaiming_uniform;
  /** With pissa: the power iterations of the approximate decomposition
   * (PEFT's "pissa_niter_<N>"), or -1 for the exact one ("pissa"). */
  int64_t pissa_niter = -1;
  /** With eva: its settings (adapter_config.json's eva_config). */
  EvaConfig eva_config{};
  /** With corda: its settings (adapter_config.json's corda_config). */
  CordaConfig corda_config{};
  /** The base model's folder, as the user named it (recorded, checked on load). */
  std::string base_model_name_or_path;
};

/** init_lora_weights as PEFT spells it: lora_init_name's, or
 * "pissa_niter_<N>". */
std::string lora_init_text(const LoraSettings& lora);

/** Sets lora.init_lora_weights (and pissa_niter) from PEFT's spelling:
 * true, gaussian, false, loftq, pissa, pissa_niter_<N>, olora, orthogonal,
 * eva or corda. Throws std::invalid_argument naming the values for another. */
void set_lora_init(LoraSettings& lora, const std::string& text);

/** True for the starts that take the adapters' part out of the base (pissa,
 * olora, corda): the trained adapters fit the residual base, and a saved folder
 * holds them converted to plain LoRA over the original weight. */
bool takes_start_from_base(LoraInit init);

/** The settings of such a folder: PEFT's save_pretrained with
 * path_initial_model_for_weight_conversion. Each adapter is [B | -B0] [A; A0]
 * (B0 A0 the start), so r and rank_pattern's values double, and lora_alpha
 * and alpha_pattern's double too (times sqrt(2) with use_rslora), keeping each
 * layer's scaling; init_lora_weights true. */
LoraSettings converted_to_lora(const LoraSettings& lora);

/** How the base is quantized (bitsandbytes' BitsAndBytesConfig, 4-bit NF4):
 * every linear layer but lm_head, as transformers' load_in_4bit does. */
struct BaseQuantization {
  int64_t blocksize = 64;
  bool double_quant = true;
  /** The dtype the weights are dequantized to (bnb_4bit_compute_dtype):
   * bf16 or f32 (f16 too). */
  DType compute_dtype = DType::bf16;
  /** Set when the adapters trained from PiSSA's, OLoRA's or CorDA's start over the
   * base with that start taken out, and were saved converted to LoRA
   * (save_peft_adapters): the start as PEFT spells it ("pissa",
   * "pissa_niter_4", "olora", "corda") and the lora_alpha they trained with. quanta
   * takes each saved adapter's second half ([B | -B0], [A; A0]) back out of
   * the base, as training had it; PEFT reads the folder as plain LoRA over
   * the original weight. Empty otherwise. */
  std::string start_taken_out;
  double start_lora_alpha = 0;
};

/** converted_to_lora's inverse for a folder whose quantization records the
 * start taken out: r, rank_pattern and alpha_pattern halved, lora_alpha the
 * recorded one, init_lora_weights the start. Throws std::invalid_argument
 * for an odd r or rank. */
LoraSettings trained_from_start(const LoraSettings& converted,
                                const BaseQuantization& quantization);

/** Splits a comma-separated list, "q_proj,v_proj" (or "all-linear"), into
 * its entries; throws std::invalid_argument naming `what` for an empty
 * entry. */
std::vector<std::string> parse_module_names(const std::string& text,
                                            const std::string& what = "target_modules");

/** Throws std::invalid_argument naming the first bad field (a regular
 * expression that does not compile among them), or a combination PEFT
 * refuses (layers_to_transform with a regex or all-linear, layers_pattern
 * without layers_to_transform). */
void check_lora_settings(const LoraSettings& lora);

/** adapter_config.json as PEFT writes it (peft_type LORA, task_type
 * CAUSAL_LM, bias none, ...), with `quantization` recording how the base
 * was quantized under the key "quanta_base_quantization" (PEFT ignores keys
 * it does not know). */
nlohmann::ordered_json adapter_config_json(const LoraSettings& lora,
                                           const BaseQuantization& quantization);

/** `lora` with exclude_modules also naming the modules of Gemma 3's
 * image-text model outside its decoder (model.vision_tower.*,
 * model.multi_modal_projector.*), as one regular expression (a list of
 * names becomes the expression matching what PEFT's list matches: a name or
 * a suffix after a dot). quanta adapts the decoder alone; PEFT, loading the
 * folder over the whole model, would otherwise adapt the vision layers that
 * all-linear or a name they share (q_proj) selects. Over the decoder's
 * names it selects what `lora` selects. */
LoraSettings excluding_vision_modules(const LoraSettings& lora);

/** Reads an adapter_config.json object (PEFT's, or ours), its key order
 * kept: rank_pattern's and alpha_pattern's first matching key wins. Throws
 * std::runtime_error naming `source` and the field for anything that is not
 * a LoRA adapter of a causal LM this library applies (another peft_type,
 * fan_in_fan_out, layer_replication, target_parameters, ...). */
LoraSettings read_adapter_config(const nlohmann::ordered_json& config, const std::string& source);

/** The base quantization recorded in an adapter_config.json; for a folder
 * PEFT wrote (no record), bitsandbytes' QLoRA settings (NF4, block 64,
 * double quant) computing in `model_dtype`, as Linear4bit does when the
 * activations are f32 or bf16. */
BaseQuantization read_base_quantization(const nlohmann::ordered_json& config,
                                        const std::string& source, DType model_dtype);

}  // namespace quanta::llm
