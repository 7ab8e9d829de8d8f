#pragma once
// A decoder's config.json as Hugging Face transformers writes it, for the
// decoders quanta runs: model_type llama, mistral, qwen2, qwen3, gemma,
// gemma2, gemma3_text, phi3, olmo2, olmo3, smollm3, granite, ministral and
// exaone4, and the decoder of
// Gemma 3's image-text model
// (gemma3: its text_config). Both generations of names are
// read: transformers 4.x's (rope_theta and rope_scaling at the top level,
// torch_dtype), which most published models carry, and 5.x's
// (rope_parameters, dtype).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "llm/kernels/gated_act.h"
#include "llm/kernels/rms_weight.h"
#include "llm/ops/rope.h"

namespace quanta::llm {

struct DecoderConfig {
  /** llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3, olmo2,
   * olmo3, smollm3, granite, ministral or exaone4. */
  std::string model_type = "llama";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  /** Absent from config.json: the model type's default in transformers
   * (llama: num_attention_heads; mistral 8; qwen2 and qwen3 32; gemma 16;
   * gemma2 4); null: num_attention_heads. */
  int64_t num_key_value_heads = 0;
  /** Absent: hidden_size / num_attention_heads (qwen3: 128; gemma and
   * gemma2: 256, their defaults). */
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  /** theta, the rotated part of head_dim (all of it, or phi3's
   * partial_rotary_factor of it), max_position_embeddings and the scaling,
   * as the RoPE ops take them. */
  RopeConfig rope;
  /** gemma3_text: the RoPE of the sliding layers (rope_local_base_freq,
   * 10000), `rope` being the full layers' (1e6, with the scaling); olmo3:
   * rope_theta without the full layers' scaling; unset: every layer takes
   * `rope`. */
  std::optional<RopeConfig> sliding_rope;
  bool tie_word_embeddings = false;
  /** Biases on q, k, v and o (llama's and qwen3's attention_bias); qwen2
   * always has them on q, k and v only; mistral never. */
  bool attention_bias = false;
  bool qkv_bias = false;  // derived: q, k, v carry biases
  bool o_bias = false;    // derived: o carries a bias
  bool mlp_bias = false;  // llama's mlp_bias; the others have none
  /** phi3's fused projections: q, k and v as one self_attn.qkv_proj
   * [q + 2 kv, hidden] (split in that order), gate and up as one
   * mlp.gate_up_proj [2 intermediate, hidden] (gate first). */
  bool fused_projections = false;
  /** qwen3: an RMSNorm over each head of q and of k (self_attn.q_norm,
   * k_norm, weights [head_dim]) before RoPE. */
  bool qk_norm = false;
  /** smollm3's layers without RoPE (NoPE; no_rope_layers' 0 entries, by
   * default every 4th layer), exaone4's full layers where it has a
   * sliding_window; empty: every layer rotates. */
  std::vector<bool> nope_layers;
  /** olmo2 and olmo3: the q and k norms span all heads (weights [heads x head_dim],
   * [kv heads x head_dim]), applied before the split into heads. */
  bool qk_norm_whole = false;
  /** The MLP's activation: SiLU, or GELU's tanh approximation (gemma's
   * hidden_act, gemma2's hidden_activation: gelu_pytorch_tanh). */
  GatedAct hidden_act = GatedAct::silu;
  /** Gemma's conventions: norms scale by 1 + weight (computed in f32,
   * rounded once), and the embeddings are multiplied by sqrt(hidden_size)
   * rounded to the model's dtype. */
  bool gemma_norms = false;
  /** gemma2's four norms a layer: the attention's and the MLP's outputs
   * normalized (post_attention_layernorm, post_feedforward_layernorm)
   * before their residual adds, the MLP's input by
   * pre_feedforward_layernorm. */
  bool sandwich_norms = false;
  /** olmo2's, olmo3's and exaone4's norms: only after each block, the attention's and the MLP's
   * outputs normalized (post_attention_layernorm,
   * post_feedforward_layernorm) before their residual adds, their inputs
   * not (no input_layernorm). */
  bool post_norms = false;
  /** The attention's scale is query_pre_attn_scalar^-0.5 (gemma2) when set,
   * else head_dim^-0.5. */
  int64_t query_pre_attn_scalar = 0;
  /** granite's multipliers: the embeddings times embedding_multiplier, each
   * block's output times residual_multiplier before its residual add, the
   * attention's scale attention_multiplier (in place of head_dim^-0.5; 0:
   * not set), the logits divided by logits_scaling; 1: none. Each is
   * applied in f32 and rounded to the model's dtype, as PyTorch applies a
   * Python number to a 16-bit tensor. */
  double embedding_multiplier = 1;
  double residual_multiplier = 1;
  double attention_multiplier = 0;
  double logits_scaling = 1;
  /** gemma2's soft-capping (cap * tanh(x / cap)) of the attention scores
   * and of the logits; 0: none. */
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  /** The weights' dtype (torch_dtype / dtype): f32, bf16 or f16. */
  DType dtype = DType::f32;
  /** Sliding-window attention: on the layers sliding_layers marks, a query
   * sees only the last sliding_window keys up to its own (mistral's
   * sliding_window on every layer; qwen2's and qwen3's with
   * use_sliding_window, from max_window_layers on; gemma2's every other
   * layer from layer 0; gemma3_text's all but every 6th; olmo3's all but
   * every 4th; smollm3's with use_sliding_window, its NoPE layers, or those
   * layer_types names; ministral's every layer unless layer_types says);
   * 0: none.
   * max_window_layers is the first sliding layer (what qwen2 writes
   * back). */
  int64_t sliding_window = 0;
  int64_t max_window_layers = 0;
  std::vector<bool> sliding_layers;
  /** Gemma 3's image-text model (model_type gemma3,
   * Gemma3ForConditionalGeneration): this config is its text_config (a
   * gemma3_text), and this is the rest of its config.json (vision_config,
   * the image tokens' ids, ...) as JSON text, kept so that a folder written
   * from the model is whole. Empty for a decoder's own config. */
  std::string image_text_config;

  /** Whether decoder layer `layer` applies RoPE to q and k (not one of
   * nope_layers). */
  bool layer_rotates(int64_t layer) const;
  /** Whether decoder layer `layer` is a sliding one (its type
   * sliding_attention, even where sliding_window is 0). */
  bool layer_slides(int64_t layer) const;
  /** The window of decoder layer `layer`: sliding_window where it slides,
   * else 0 (full causal attention). */
  int64_t layer_window(int64_t layer) const;

  /** How the model's RMSNorms apply their weights: Gemma's 1 + weight
   * (gemma_norms), OLMo 2's single rounding, else Llama's. */
  RmsWeight norm_weight() const;

  /** The attention's scale: attention_multiplier, query_pre_attn_scalar^-0.5
   * or head_dim^-0.5. */
  double attention_scale() const;

  /** The module holding the decoder's embeddings, layers and final norm,
   * as transformers names it: "model", or "model.language_model" in an
   * image-text model (lm_head is "lm_head" in both). */
  std::string decoder_module() const;

  /** Parameters of the decoder (an image-text model's vision tower not
   * counted), embeddings counted once when tied. */
  int64_t parameter_count() const;
};

/** Parses config.json text; `source` (a path) names the file in errors.
 * Gemma 3's image-text config (gemma3) gives its text_config's decoder,
 * Gemma3TextConfig's defaults filling what it leaves out, with
 * image_text_config set.
 * Throws std::invalid_argument naming the key that is missing, has the wrong
 * type or a value quanta does not run (another model_type, an activation
 * other than the model's, qwen sliding-window layers other than the last
 * ones, gemma2's other than its alternation, partial rotary,
 * interleaved RoPE, a rope_scaling kind
 * outside default, linear, dynamic, llama3, longrope, yarn). Keys that do not change the
 * computation (architectures, token ids, dropout, use_cache, ...) are
 * ignored. */
DecoderConfig parse_decoder_config(const std::string& json_text, const std::string& source);

/** Reads `path` (a config.json) with parse_decoder_config. */
DecoderConfig read_decoder_config(const std::string& path);

/** PyTorch's name of a model dtype: "float32", "bfloat16", "float16" or
 * "float64" (throws std::invalid_argument for another dtype). */
const char* torch_dtype_name(DType dtype);
/** The model dtype PyTorch calls `name` ("float32", "bfloat16", "float16",
 * "float64"); throws std::invalid_argument naming it for anything else. */
DType dtype_from_torch_name(const std::string& name);

/** config.json text for `c` in transformers 4.x's names (the ones every
 * version of transformers reads); an image-text model's is its outer
 * config with `c` as text_config. */
std::string decoder_config_json(const DecoderConfig& c);

}  // namespace quanta::llm
