#pragma once
// A decoder-only language model of the Llama family and its relatives
// (llama, mistral, qwen2, qwen3, gemma, gemma2), laid out as transformers'
// *ForCausalLM so that its state dict has their names: model.embed_tokens,
// model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj (qwen3: and
// self_attn.{q,k}_norm), post_attention_layernorm (gemma2: and
// pre_feedforward_layernorm, post_feedforward_layernorm),
// mlp.{gate,up,down}_proj}, model.norm, lm_head (absent when the embeddings
// are tied). Projections are engine Linear modules, so NF4 and LoRA
// conversions replace them in place.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "llm/model/config.h"
#include "llm/model/trainable_tokens.h"

namespace quanta::llm {

/** The keys and values of the positions seen so far, per layer
 * ([batch, length, kv_heads, head_dim] each), for generation: a forward with
 * a cache reads them and appends its own. */
struct KVCache {
  std::vector<Tensor> keys, values;
  /** Positions held (0 for a new cache). */
  int64_t length() const { return keys.empty() ? 0 : keys[0].size(1); }
};

/** RMSNorm with a learned scale, applied as the model family's class
 * applies it (llm::rms_norm's `how`: LlamaRMSNorm, GemmaRMSNorm's 1 +
 * weight, Olmo2RMSNorm's single rounding). */
class RMSNorm : public Module {
 public:
  RMSNorm(const Tensor& weight, double eps, RmsWeight how = RmsWeight::rounded_first);
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }

 private:
  Tensor weight_;
  double eps_;
  RmsWeight how_;
};

class CausalLM : public Module {
 public:
  /** Builds the model around `weights` (transformers' names, as a folder
   * stores them: weight_names.h), taken as they are when already of
   * config.dtype (no copy), else converted to it. Throws one error listing
   * every missing name, unexpected name and wrong shape. A tied model may
   * carry lm_head.weight (ignored, as transformers ties it); an image-text
   * model's vision tower and projector are left out. */
  CausalLM(DecoderConfig config, const StateDict& weights);
  /** Random weights (normal, std init_std; norms at 1) in config.dtype on
   * `device`: for benchmarks and tests. */
  static std::shared_ptr<CausalLM> random(const DecoderConfig& config, Generator& gen,
                                          Device device = Device::cpu(), double init_std = 0.02);
  /** The names and shapes a model of `config` has, in state-dict order. */
  static std::vector<std::pair<std::string, Shape>> expected_weights(const DecoderConfig& config);
  /** Throws std::invalid_argument when `config` has more decoder layers
   * than the weights named `names` hold ("<decoder_module>.layers.N." prefixes, N from
   * 0), before anything per layer is built or listed: a config of 10^9
   * layers over a 2-layer model is one error, not 10^9 missing layers.
   * (Layers beyond the config's are reported by the constructor as
   * unexpected names.) */
  static void check_layer_count(const DecoderConfig& config, const std::vector<std::string>& names);

  /** The final hidden states [batch, tokens, hidden_size] (after model.norm)
   * of ids [batch, tokens] (i64, each < vocab_size). With `cache`, ids
   * continue the cached sequence (positions from cache->length()) and the
   * cache grows by `tokens`. `attention_mask` [batch, cache length + tokens]
   * (bool, or integers with 1 for a real token and 0 for padding) hides the
   * padding keys, as transformers' attention_mask does. `position_ids`
   * [batch or 1, tokens] (i64) replaces the positions 0, 1, ... (after the
   * cache); without a cache or attention_mask, positions that restart mark
   * packed documents, as transformers reads them: a document starts wherever
   * a position is not the previous one plus 1, and a token attends only to
   * earlier tokens of its own document. */
  Tensor hidden_states(const Tensor& ids, KVCache* cache = nullptr,
                       const Tensor& attention_mask = Tensor(),
                       const Tensor& position_ids = Tensor());
  /** Logits [batch, tokens, vocab_size] in config.dtype: lm_head of
   * hidden_states (gemma2: soft-capped by final_logit_softcapping). */
  Tensor logits(const Tensor& ids, KVCache* cache = nullptr,
                const Tensor& attention_mask = Tensor(), const Tensor& position_ids = Tensor());
  /** The output projection's weight [vocab_size, hidden_size] (the
   * embeddings when tied), with its trainable tokens' rows. */
  Tensor lm_head_weight() const;
  /** The causal-LM loss of hidden_states' output against labels [batch,
   * tokens] (chunked_causal_lm_loss: transformers' shift, ignore_index
   * -100), through the output layer as the model has it: soft-capped
   * logits for gemma2, and with trainable tokens on the output layer their
   * rows' gradient alone (the weight a constant made without a graph).
   * chunk_tokens 0: the automatic chunk. */
  Tensor lm_loss(const Tensor& hidden, const Tensor& labels, int64_t chunk_tokens = 0) const;

  /** The embeddings' module name: "model.embed_tokens" (an image-text
   * model's "model.language_model.embed_tokens"). */
  std::string embed_tokens_name() const { return config_.decoder_module() + ".embed_tokens"; }
  /** PEFT's trainable tokens: rows `indices` of the embeddings
   * (`module` embed_tokens_name(); a tied output layer takes them too) or
   * of the output layer ("lm_head", untied) train, a TrainableTokens
   * "token_adapter" under that module (frozen until set to train). Throws
   * std::invalid_argument for another module, lm_head of a tied model, a
   * module that has them already, or indices TrainableTokens refuses. */
  void add_trainable_tokens(const std::string& module, std::vector<int64_t> indices);
  /** The rows of lm_head_weight() that train when only they do (its
   * trainable tokens; a tied model's are the embeddings'), as
   * TrainableTokens::rows(); undefined otherwise. For
   * chunked_causal_lm_loss's trained_rows. */
  Tensor lm_head_trained_rows() const;
  /** Their values (the trainable tokens' parameter), to go with
   * lm_head_trained_rows(); undefined without. */
  Tensor lm_head_trained_values() const;
  /** The modules with trainable tokens, by name, embeddings first. */
  std::vector<std::pair<std::string, const TrainableTokens*>> trainable_tokens() const;
  /** Writes each trainable tokens' rows into its layer's weight and drops
   * them: the model a merged fine-tune saves. */
  void merge_trainable_tokens();

  /** Activation recomputation per decoder layer: with it on, a forward that
   * builds a graph (training, no cache) keeps only each layer's input and
   * runs the layer again in the backward (quanta::recompute), so activation
   * memory is one layer's plus the layer inputs, for about a third more
   * compute. Values and gradients are the same either way (dropout draws
   * included). Off by default. */
  void set_recompute_layers(bool on) { recompute_layers_ = on; }
  bool recompute_layers() const { return recompute_layers_; }

  /** NEFTune (Jain et al. 2023; transformers' neftune_noise_alpha): in
   * training, noise uniform in [-alpha / sqrt(T d), alpha / sqrt(T d)) is
   * added to the input embeddings [B, T, d], where transformers' hook on
   * the embedding module adds it (after Gemma's scaling, which its
   * embedding module does; before Granite's multiplier, which its model
   * does). Drawn from the stream named "neftune" of `seed` on the model's
   * device, a training checkpoint keeping its state (own_random_streams).
   * Evaluation and generation add nothing; 0 turns it off. Throws
   * std::invalid_argument for alpha < 0 or not finite. */
  void set_neftune_noise(double alpha, uint64_t seed);
  double neftune_noise_alpha() const { return neftune_alpha_; }
  std::vector<Generator*> own_random_streams() override;

  /** The decoder layers' module names, in order ("model.layers.0", ...):
   * the units a sharded base is gathered by. Each layer's forward runs
   * inside its forward hooks (Module::ForwardScope). */
  std::vector<std::string> layer_names() const;

  const DecoderConfig& config() const { return config_; }
  Device device() const;

  /** Leaves the weights `names` (the model's names, "model.layers.0.mlp.up_proj.weight")
   * in their files: their tensors keep their shape, dtype and device but hold no
   * bytes until read_deferred_weights gives them theirs through `read(name)` (any
   * float dtype, any device). Until then the model runs no forward. For
   * load_causal_lm's defer_layer_weights: apply_qlora reads each layer's weight as
   * it converts it, so the float model is never whole in memory. */
  void defer_weights(std::vector<std::string> names,
                     std::function<Tensor(const std::string&)> read);
  /** The weights still in their files, in model order. */
  std::vector<std::string> deferred_weights() const;
  /** Reads the deferred weights of module `prefix` (itself and those inside it;
   * every one when empty) into their tensors, in the model's dtype, on `where`
   * (their own device when not given). apply_qlora reads a layer's onto the host,
   * where bitsandbytes' layout is built, and sends only the 4-bit base to the
   * model's device. */
  void read_deferred_weights(const std::string& prefix = "",
                             std::optional<Device> where = std::nullopt);

 private:
  DecoderConfig config_;
  std::shared_ptr<Module> decoder_;  // the module holding embed_, the layers and norm_
  std::shared_ptr<Embedding> embed_;
  std::vector<std::shared_ptr<Module>> layers_;
  std::shared_ptr<RMSNorm> norm_;
  std::shared_ptr<Linear> lm_head_;
  std::shared_ptr<TrainableTokens> embed_tokens_adapter_, lm_head_adapter_;
  bool recompute_layers_ = false;
  std::vector<std::string> deferred_;  // defer_weights' names still unread
  std::function<Tensor(const std::string&)> read_deferred_;
  double neftune_alpha_ = 0;
  Generator neftune_gen_{0};
  /** The embeddings' weight with their trainable tokens' rows. */
  Tensor input_embedding_weight() const;
  /** The trainable tokens of the output layer (the embeddings' when tied),
   * or null. */
  const TrainableTokens* lm_head_tokens() const;
};

}  // namespace quanta::llm
