// CausalLM: weights by transformers' names into modules, and the decoder's
// forward (embeddings (Gemma: scaled by sqrt(hidden_size); Granite: by its
// multiplier), N x [RMSNorm, attention with RoPE and grouped heads (Qwen3:
// each head of q and k RMS-normalized first; Gemma 2: soft-capped scores;
// Phi-3: q, k and v from one product, part of each head rotated; SmolLM3 and
// EXAONE 4: some layers without RoPE), (Gemma 2: RMSNorm), residual (Granite:
// the block's output scaled), RMSNorm, SiLU- or GELU-gated MLP (Phi-3: gate
// and up from one product), (Gemma 2: RMSNorm), residual], RMSNorm, lm_head
// (Gemma 2: soft-capped; Granite: divided)). OLMo 2 and 3 and EXAONE 4
// normalize only after each block.
#include "llm/model/causal_lm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/nn/recompute.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"
#include "engine/shared_bf16_input.h"
#include "llm/model/lm_loss.h"
#include "llm/model/weight_names.h"
#include "llm/ops/attention.h"
#include "llm/ops/gated_act.h"
#include "llm/ops/rms_norm.h"
#include "llm/ops/rope.h"

namespace quanta::llm {
namespace {

// A sequence length past any RoPE scaling's original length.
constexpr int64_t kMaxLength = std::numeric_limits<int64_t>::max();

// x times Granite's multiplier m, computed in f32 and rounded once to x's
// dtype, as PyTorch multiplies a 16-bit tensor by a Python number (a scalar
// of x's dtype would round m first: Granite's 0.22 to 0.2197 in bf16).
Tensor times_multiplier(const Tensor& x, double m) {
  if (m == 1) return x;
  if (x.dtype() == DType::f32 || x.dtype() == DType::f64) return x * m;
  return (x.to(DType::f32) * m).to(x.dtype());
}

// Hands out the weights by name, checking shapes; collects every problem so
// that one error lists them all.
class WeightTaker {
 public:
  WeightTaker(const StateDict& weights, DType dtype) : dtype_(dtype) {
    for (const auto& [name, t] : weights) left_.emplace(name, t);
  }
  Tensor take(const std::string& name, const Shape& shape) {
    auto it = left_.find(name);
    if (it == left_.end()) {
      missing_.push_back(name + " " + shape_str(shape));
      return placeholder(shape);
    }
    Tensor t = it->second;
    left_.erase(it);
    if (t.shape() != shape) {
      wrong_.push_back(name + " is " + shape_str(t.shape()) + ", expected " + shape_str(shape));
      return placeholder(shape);
    }
    if (!is_floating(t.dtype())) {
      wrong_.push_back(name + " has dtype " + std::string(dtype_name(t.dtype())));
      return placeholder(shape);
    }
    return t.dtype() == dtype_ ? t : t.to(dtype_);
  }
  void drop(const std::string& name) { left_.erase(name); }
  // The weight stored under `name`, if any (not taken).
  const Tensor* find(const std::string& name) const {
    const auto it = left_.find(name);
    return it == left_.end() ? nullptr : &it->second;
  }
  // Stands in for a weight that is wrong until finish() reports it: one
  // zero, broadcast, so that a config of absurd sizes allocates nothing.
  Tensor placeholder(const Shape& shape) const {
    return expand(zeros(Shape(shape.size(), 1), {.dtype = dtype_}), shape);
  }
  void finish() const {
    if (missing_.empty() && wrong_.empty() && left_.empty()) return;
    std::ostringstream e;
    e << "[CausalLM] the weights do not match the config:";
    const auto list = [&](const char* what, const std::vector<std::string>& names) {
      if (names.empty()) return;
      e << "\n  " << what << " (" << names.size() << "):";
      for (const auto& n : names) e << "\n    " << n;
    };
    list("missing", missing_);
    list("wrong shape or dtype", wrong_);
    std::vector<std::string> unexpected;
    for (const auto& [name, t] : left_) unexpected.push_back(name);
    list("unexpected", unexpected);
    throw std::invalid_argument(e.str());
  }

 private:
  DType dtype_;
  std::map<std::string, Tensor> left_;
  std::vector<std::string> missing_, wrong_;
};

// A module that only groups children (transformers' LlamaModel, ModuleList).
class Group : public Module {
 public:
  explicit Group(const char* type) : Module(type) {}
};

// One child slot that follows replace_module (NF4 and LoRA conversions).
struct ChildSlot {
  const char* name;
  std::shared_ptr<Module>* module;
};

// A tied model's file may hold lm_head.weight as a copy of the embeddings;
// any other lm_head is refused: tied, the embeddings are the output layer,
// while transformers 5.24 unties the two and uses the stored one, so the
// file means two models and quanta cannot tell which was meant.
// Compared as transformers compares them, in the model's dtype.
void check_tied_copy(const Tensor* lm_head, const Tensor* embed, DType dtype) {
  if (!lm_head || !embed) return;
  bool copy = lm_head->shape() == embed->shape();
  if (copy) {
    const Tensor a = lm_head->to(Device::cpu()).to(dtype).contiguous();
    const Tensor b = embed->to(Device::cpu()).to(dtype).contiguous();
    copy = std::memcmp(a.raw_data(), b.raw_data(),
                       static_cast<size_t>(a.numel()) * element_size(a.dtype())) == 0;
  }
  if (!copy)
    throw std::invalid_argument(
        "[CausalLM] tie_word_embeddings is true, but the weights hold an lm_head.weight that "
        "differs from model.embed_tokens.weight (transformers 5.24 then unties the two and uses "
        "it; tied, the embeddings are the output layer): set tie_word_embeddings to false in "
        "config.json to use it, or remove it from the weights to tie");
}

class Attention : public Module {
 public:
  Attention(const DecoderConfig& c, WeightTaker& w, const std::string& prefix, int64_t layer)
      : Module("Attention"),
        c_(c),
        window_(c.layer_window(layer)),
        rotates_(c.layer_rotates(layer)) {
    const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
    const auto proj = [&](const char* name, int64_t out, int64_t in, bool bias) {
      const std::string p = prefix + name;
      Tensor weight = w.take(p + ".weight", {out, in});
      Tensor b = bias ? w.take(p + ".bias", {out}) : Tensor();
      return register_module(name, std::shared_ptr<Module>(std::make_shared<Linear>(weight, b)));
    };
    if (c.fused_projections) {  // Phi-3: one product, split q | k | v
      // transformers' order there: o_proj first.
      o_ = proj("o_proj", c.hidden_size, q, c.o_bias);
      q_ = proj("qkv_proj", q + 2 * kv, c.hidden_size, c.qkv_bias);
    } else {
      q_ = proj("q_proj", q, c.hidden_size, c.qkv_bias);
      k_ = proj("k_proj", kv, c.hidden_size, c.qkv_bias);
      v_ = proj("v_proj", kv, c.hidden_size, c.qkv_bias);
      o_ = proj("o_proj", c.hidden_size, q, c.o_bias);
    }
    if (c.qk_norm) {
      // Over each head (Qwen3, Gemma 3), or over all of q's heads together
      // and all of k's (OLMo 2).
      const auto qk_norm = [&](const char* name, int64_t width) {
        return register_module(name,
                               std::make_shared<RMSNorm>(w.take(prefix + name + ".weight", {width}),
                                                         c.rms_norm_eps, c.norm_weight()));
      };
      q_norm_ = qk_norm("q_norm", c.qk_norm_whole ? q : c.head_dim);
      k_norm_ = qk_norm("k_norm", c.qk_norm_whole ? kv : c.head_dim);
    }
  }
  std::shared_ptr<Module> replace_module(const std::string& name,
                                         std::shared_ptr<Module> m) override {
    auto old = Module::replace_module(name, m);
    for (const ChildSlot& s :
         {ChildSlot{"q_proj", &q_}, ChildSlot{"qkv_proj", &q_}, ChildSlot{"k_proj", &k_},
          ChildSlot{"v_proj", &v_}, ChildSlot{"o_proj", &o_}})
      if (name == s.name) *s.module = m;
    return old;
  }
  Tensor forward(const Tensor& x, const RopeTables& rope, KVCache* cache, size_t layer,
                 const Tensor& mask) {
    const int64_t B = x.size(0), T = x.size(1), D = c_.head_dim;
    const int64_t H = c_.num_attention_heads, KV = c_.num_key_value_heads;
    Tensor q, k, v;
    if (!k_) {
      const Tensor qkv = q_->forward(x);
      q = slice(qkv, 2, 0, H * D);
      k = slice(qkv, 2, H * D, (H + KV) * D);
      v = slice(qkv, 2, (H + KV) * D, (H + 2 * KV) * D);
    } else {
      // One bf16 rounding of x for the three (NF4 layers computing in bf16).
      const SharedBf16Input shared(x);
      q = q_->forward(x);
      k = k_->forward(x);
      v = v_->forward(x);
    }
    v = reshape(v, {B, T, KV, D});
    // OLMo 2: q and k normalized over all their heads, before the split.
    if (q_norm_ && c_.qk_norm_whole) {
      q = q_norm_->forward(q);
      k = k_norm_->forward(k);
    }
    q = reshape(q, {B, T, H, D});
    k = reshape(k, {B, T, KV, D});
    if (q_norm_ && !c_.qk_norm_whole) {  // Qwen3: each head over head_dim, before RoPE
      q = q_norm_->forward(q);
      k = k_norm_->forward(k);
    }
    if (rotates_) {  // SmolLM3's and EXAONE 4's NoPE layers attend without positions
      q = apply_rope(q, rope);
      k = apply_rope(k, rope);
    }
    if (cache) {
      if (cache->keys.size() <= layer) {
        cache->keys.resize(layer + 1);
        cache->values.resize(layer + 1);
      }
      if (cache->keys[layer].defined()) {
        k = cat({cache->keys[layer], k}, 1);
        v = cat({cache->values[layer], v}, 1);
      }
      cache->keys[layer] = k.detach();
      cache->values[layer] = v.detach();
    }
    AttentionOptions o;
    o.causal = true;
    o.scale = c_.attention_scale();
    o.softcap = c_.attn_logit_softcapping;
    o.window = window_;
    o.mask = mask;
    const Tensor a = scaled_dot_product_attention(q, k, v, o);
    return o_->forward(reshape(a, {B, T, c_.num_attention_heads * D}));
  }

 private:
  DecoderConfig c_;
  int64_t window_;                            // this layer's sliding window (0: none)
  bool rotates_;                              // RoPE on q and k (not a NoPE layer)
  std::shared_ptr<Module> q_, k_, v_, o_;     // q_ is qkv_proj when fused (k_, v_ unset)
  std::shared_ptr<RMSNorm> q_norm_, k_norm_;  // qk_norm only
};

class MLP : public Module {
 public:
  MLP(const DecoderConfig& c, WeightTaker& w, const std::string& prefix)
      : Module("MLP"), act_(c.hidden_act) {
    const auto proj = [&](const char* name, int64_t out, int64_t in) {
      const std::string p = prefix + name;
      Tensor weight = w.take(p + ".weight", {out, in});
      Tensor b = c.mlp_bias ? w.take(p + ".bias", {out}) : Tensor();
      return register_module(name, std::shared_ptr<Module>(std::make_shared<Linear>(weight, b)));
    };
    if (c.fused_projections) {  // Phi-3: one product, split gate | up
      gate_ = proj("gate_up_proj", 2 * c.intermediate_size, c.hidden_size);
    } else {
      gate_ = proj("gate_proj", c.intermediate_size, c.hidden_size);
      up_ = proj("up_proj", c.intermediate_size, c.hidden_size);
    }
    down_ = proj("down_proj", c.hidden_size, c.intermediate_size);
  }
  std::shared_ptr<Module> replace_module(const std::string& name,
                                         std::shared_ptr<Module> m) override {
    auto old = Module::replace_module(name, m);
    for (const ChildSlot& s : {ChildSlot{"gate_proj", &gate_}, ChildSlot{"gate_up_proj", &gate_},
                               ChildSlot{"up_proj", &up_}, ChildSlot{"down_proj", &down_}})
      if (name == s.name) *s.module = m;
    return old;
  }
  Tensor forward(const Tensor& x) override { return forward(x, false); }
  // `output_unread`: the result is only differentiated through (the layer
  // recomputed), so down_proj's frozen product need not be computed.
  Tensor forward(const Tensor& x, bool output_unread) {
    Tensor gate, up;
    if (!up_) {
      const Tensor gate_up = gate_->forward(x);
      const int64_t f = gate_up.size(-1) / 2;
      gate = slice(gate_up, gate_up.dim() - 1, 0, f);
      up = slice(gate_up, gate_up.dim() - 1, f, 2 * f);
    } else {
      const SharedBf16Input shared(x);  // one bf16 rounding of x for the two
      gate = gate_->forward(x);
      up = up_->forward(x);
    }
    const Tensor h = gated_activation(gate, up, act_);
    const UnreadOutputGuard unread(output_unread);
    return down_->forward(h);
  }

 private:
  std::shared_ptr<Module> gate_, up_, down_;  // gate_ is gate_up_proj when fused (up_ unset)
  GatedAct act_;
};

class DecoderLayer : public Module {
 public:
  DecoderLayer(const DecoderConfig& c, WeightTaker& w, int64_t layer)
      : Module("DecoderLayer"), residual_multiplier_(c.residual_multiplier) {
    const std::string prefix = c.decoder_module() + ".layers." + std::to_string(layer) + ".";
    attn_ = register_module("self_attn",
                            std::make_shared<Attention>(c, w, prefix + "self_attn.", layer));
    mlp_ = register_module("mlp", std::make_shared<MLP>(c, w, prefix + "mlp."));
    const auto norm = [&](const char* name) {
      return register_module(
          name, std::make_shared<RMSNorm>(w.take(prefix + name + ".weight", {c.hidden_size}),
                                          c.rms_norm_eps, c.norm_weight()));
    };
    if (!c.post_norms) in_norm_ = norm("input_layernorm");
    post_norm_ = norm("post_attention_layernorm");
    if (c.sandwich_norms) pre_mlp_norm_ = norm("pre_feedforward_layernorm");
    if (c.sandwich_norms || c.post_norms) post_mlp_norm_ = norm("post_feedforward_layernorm");
  }
  Tensor forward(const Tensor& h, const RopeTables& rope, KVCache* cache, size_t layer,
                 const Tensor& mask) {
    // Recomputed, the layer's output is differentiated, never read (the next
    // layer's input was kept): its last product is skipped. The attention's
    // output is read (the MLP's input), so only the MLP's last one; Gemma
    // 2's and OLMo 2's norm after the MLP reads its output, so nothing is
    // skipped there.
    // Granite scales each block's output before its residual add.
    const double m = residual_multiplier_;
    const Tensor attn =
        attn_->forward(in_norm_ ? in_norm_->forward(h) : h, rope, cache, layer, mask);
    if (!post_mlp_norm_) {
      const Tensor a = add(h, times_multiplier(attn, m));
      return add(a, times_multiplier(mlp_->forward(post_norm_->forward(a), recomputing()), m));
    }
    // Gemma 2, OLMo 2 and 3, EXAONE 4: each block's output normalized before
    // its residual add (Gemma 2 normalizes the MLP's input too).
    const Tensor a = add(h, post_norm_->forward(attn));
    return add(
        a, post_mlp_norm_->forward(mlp_->forward(pre_mlp_norm_ ? pre_mlp_norm_->forward(a) : a)));
  }

 private:
  std::shared_ptr<Attention> attn_;
  std::shared_ptr<MLP> mlp_;
  std::shared_ptr<RMSNorm> in_norm_, post_norm_;  // in_norm_: not with post_norms
  std::shared_ptr<RMSNorm> pre_mlp_norm_;         // sandwich_norms only
  std::shared_ptr<RMSNorm> post_mlp_norm_;        // sandwich_norms or post_norms
  double residual_multiplier_;                    // granite's; 1: none
};

}  // namespace

RMSNorm::RMSNorm(const Tensor& weight, double eps, RmsWeight how)
    : Module("RMSNorm"), eps_(eps), how_(how) {
  weight_ = register_parameter("weight", weight);
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight_, eps_, how_); }

std::vector<std::pair<std::string, Shape>> CausalLM::expected_weights(const DecoderConfig& c) {
  std::vector<std::pair<std::string, Shape>> out;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const int64_t d = c.hidden_size, f = c.intermediate_size;
  const std::string root = c.decoder_module() + ".";
  out.push_back({root + "embed_tokens.weight", {c.vocab_size, d}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = root + "layers." + std::to_string(l) + ".";
    const auto proj = [&](const std::string& name, int64_t o, int64_t i, bool bias) {
      out.push_back({p + name + ".weight", {o, i}});
      if (bias) out.push_back({p + name + ".bias", {o}});
    };
    if (c.fused_projections) {
      proj("self_attn.o_proj", d, q, c.o_bias);
      proj("self_attn.qkv_proj", q + 2 * kv, d, c.qkv_bias);
    } else {
      proj("self_attn.q_proj", q, d, c.qkv_bias);
      proj("self_attn.k_proj", kv, d, c.qkv_bias);
      proj("self_attn.v_proj", kv, d, c.qkv_bias);
      proj("self_attn.o_proj", d, q, c.o_bias);
    }
    if (c.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {c.qk_norm_whole ? q : c.head_dim}});
      out.push_back({p + "self_attn.k_norm.weight", {c.qk_norm_whole ? kv : c.head_dim}});
    }
    if (c.fused_projections) {
      proj("mlp.gate_up_proj", 2 * f, d, c.mlp_bias);
    } else {
      proj("mlp.gate_proj", f, d, c.mlp_bias);
      proj("mlp.up_proj", f, d, c.mlp_bias);
    }
    proj("mlp.down_proj", d, f, c.mlp_bias);
    if (!c.post_norms) out.push_back({p + "input_layernorm.weight", {d}});
    out.push_back({p + "post_attention_layernorm.weight", {d}});
    if (c.sandwich_norms) out.push_back({p + "pre_feedforward_layernorm.weight", {d}});
    if (c.sandwich_norms || c.post_norms)
      out.push_back({p + "post_feedforward_layernorm.weight", {d}});
  }
  out.push_back({root + "norm.weight", {d}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, d}});
  return out;
}

CausalLM::CausalLM(DecoderConfig config, const StateDict& stored)
    : Module("CausalLM"), config_(std::move(config)) {
  const DecoderConfig& c = config_;
  const StateDict weights = decoder_weights(c, stored);
  std::vector<std::string> names;
  for (const auto& [name, t] : weights) names.push_back(name);
  check_layer_count(c, names);
  WeightTaker w(weights, c.dtype);
  const std::string root = c.decoder_module() + ".";
  // Checkpoints of the Llama 2 era persisted RoPE's inverse frequencies; they
  // are computed, never loaded.
  for (const auto& [name, t] : weights)
    if (name.size() > 20 && name.compare(name.size() - 20, 20, "rotary_emb.inv_freq") == 0)
      w.drop(name);
  if (c.tie_word_embeddings) {
    check_tied_copy(w.find("lm_head.weight"), w.find(root + "embed_tokens.weight"), c.dtype);
    w.drop("lm_head.weight");
  }
  std::shared_ptr<Group> model = register_module("model", std::make_shared<Group>("Model"));
  // An image-text model's decoder is model.language_model, beside the
  // vision tower quanta does not load.
  if (!c.image_text_config.empty())
    model = model->register_module("language_model", std::make_shared<Group>("TextModel"));
  decoder_ = model;
  embed_ = model->register_module(
      "embed_tokens", std::make_shared<Embedding>(
                          w.take(root + "embed_tokens.weight", {c.vocab_size, c.hidden_size})));
  auto layers = model->register_module("layers", std::make_shared<Group>("ModuleList"));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string n = std::to_string(l);
    layers_.push_back(layers->register_module(
        n, std::shared_ptr<Module>(std::make_shared<DecoderLayer>(c, w, l))));
  }
  norm_ = model->register_module(
      "norm", std::make_shared<RMSNorm>(w.take(root + "norm.weight", {c.hidden_size}),
                                        c.rms_norm_eps, c.norm_weight()));
  if (!c.tie_word_embeddings)
    lm_head_ = register_module("lm_head", std::make_shared<Linear>(w.take(
                                              "lm_head.weight", {c.vocab_size, c.hidden_size})));
  w.finish();
}

void CausalLM::check_layer_count(const DecoderConfig& config,
                                 const std::vector<std::string>& names) {
  const std::string prefix = config.decoder_module() + ".layers.";
  int64_t stored = 0;  // 1 + the largest layer index named
  for (const std::string& name : names) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::size_t dot = name.find('.', prefix.size());
    const std::string index = name.substr(prefix.size(), dot - prefix.size());
    if (index.empty() || index.size() > 9 ||
        index.find_first_not_of("0123456789") != std::string::npos)
      continue;  // not a layer index: finish() reports the name as unexpected
    stored = std::max<int64_t>(stored, std::stoll(index) + 1);
  }
  if (config.num_hidden_layers > stored)
    throw std::invalid_argument("[CausalLM] the config says num_hidden_layers " +
                                std::to_string(config.num_hidden_layers) + ", the weights hold " +
                                (stored == 0 ? std::string("no decoder layer")
                                             : "layers 0.." + std::to_string(stored - 1) + " (" +
                                                   std::to_string(stored) + ")"));
}

std::shared_ptr<CausalLM> CausalLM::random(const DecoderConfig& config, Generator& gen,
                                           Device device, double init_std) {
  StateDict sd;
  for (const auto& [name, shape] : expected_weights(config)) {
    const bool norm = name.find("norm.weight") != std::string::npos;
    const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    // Norms scale by 1: Gemma's store the offset from 1.
    Tensor t = norm   ? full(shape, config.gemma_norms ? 0.0 : 1.0, {.device = device})
               : bias ? zeros(shape, {.device = device})
                      : randn(shape, gen, {.device = device}) * init_std;
    sd.push_back({name, t.to(config.dtype)});
  }
  return std::make_shared<CausalLM>(config, sd);
}

Device CausalLM::device() const { return embed_->weight().device(); }

void CausalLM::defer_weights(std::vector<std::string> names,
                             std::function<Tensor(const std::string&)> read) {
  for (const std::string& name : names)
    if (!find(name).defined())
      throw std::invalid_argument("[CausalLM::defer_weights] the model has no weight " + name);
  deferred_ = std::move(names);
  read_deferred_ = std::move(read);
}

std::vector<std::string> CausalLM::deferred_weights() const { return deferred_; }

void CausalLM::read_deferred_weights(const std::string& prefix, std::optional<Device> where) {
  std::vector<std::string> left;
  for (const std::string& name : deferred_) {
    if (!prefix.empty() &&
        !(name.size() > prefix.size() && name.starts_with(prefix) && name[prefix.size()] == '.')) {
      left.push_back(name);
      continue;
    }
    const Tensor slot = find(name);
    const Device device = where.value_or(slot.device());
    Tensor read = read_deferred_(name);
    if (read.shape() != slot.shape())
      throw std::runtime_error("[CausalLM] weight " + name + " read back as " +
                               shape_str(read.shape()) + ", not " + shape_str(slot.shape()) +
                               " (was its file changed while the model was loading?)");
    read = read.to(slot.dtype()).to(device).contiguous();
    // Every handle of the weight (its module's, the registry's) sees the bytes.
    TensorImpl* impl = slot.impl();
    impl->storage = read.storage();
    impl->offset = read.offset();
    impl->strides = read.strides();
  }
  deferred_ = std::move(left);
  if (deferred_.empty()) read_deferred_ = nullptr;
}

Tensor CausalLM::input_embedding_weight() const {
  return embed_tokens_adapter_ ? embed_tokens_adapter_->apply(embed_->weight()) : embed_->weight();
}

Tensor CausalLM::lm_head_weight() const {
  if (!lm_head_) return input_embedding_weight();  // tied
  return lm_head_adapter_ ? lm_head_adapter_->apply(lm_head_->weight()) : lm_head_->weight();
}

const TrainableTokens* CausalLM::lm_head_tokens() const {
  // A tied model's output layer is the embeddings, and takes their rows.
  return (lm_head_ ? lm_head_adapter_ : embed_tokens_adapter_).get();
}

Tensor CausalLM::lm_head_trained_rows() const {
  const TrainableTokens* tokens = lm_head_tokens();
  return tokens ? tokens->rows() : Tensor();
}

Tensor CausalLM::lm_head_trained_values() const {
  const TrainableTokens* tokens = lm_head_tokens();
  return tokens ? tokens->values() : Tensor();
}

void CausalLM::add_trainable_tokens(const std::string& module, std::vector<int64_t> indices) {
  const bool embeddings = module == embed_tokens_name();
  if (!embeddings && module != "lm_head")
    throw std::invalid_argument("trainable tokens go on " + embed_tokens_name() +
                                " or lm_head, not " + module);
  if (!embeddings && !lm_head_)
    throw std::invalid_argument(
        "trainable tokens on lm_head of a model with tie_word_embeddings: its output layer is "
        "the embeddings (give the indices to embed_tokens)");
  std::shared_ptr<TrainableTokens>& slot = embeddings ? embed_tokens_adapter_ : lm_head_adapter_;
  if (slot) throw std::invalid_argument(module + " has trainable tokens already");
  Module& layer = embeddings ? static_cast<Module&>(*embed_) : static_cast<Module&>(*lm_head_);
  auto adapter = std::make_shared<TrainableTokens>(
      embeddings ? embed_->weight() : lm_head_->weight(), std::move(indices));
  for (auto& [name, p] : adapter->named_parameters()) {
    Tensor t = p;
    t.requires_grad_(false);
  }
  slot = layer.register_module("token_adapter", adapter);
}

std::vector<std::pair<std::string, const TrainableTokens*>> CausalLM::trainable_tokens() const {
  std::vector<std::pair<std::string, const TrainableTokens*>> out;
  if (embed_tokens_adapter_) out.emplace_back(embed_tokens_name(), embed_tokens_adapter_.get());
  if (lm_head_adapter_) out.emplace_back("lm_head", lm_head_adapter_.get());
  return out;
}

void CausalLM::merge_trainable_tokens() {
  NoGradGuard no_grad;
  // The layers are replaced by ones holding the merged weights (the
  // adapters go with the old ones).
  if (embed_tokens_adapter_) {
    auto merged = std::make_shared<Embedding>(input_embedding_weight().contiguous());
    decoder_->replace_module("embed_tokens", merged);
    embed_ = merged;
    embed_tokens_adapter_.reset();
  }
  if (lm_head_adapter_) {
    auto merged = std::make_shared<Linear>(lm_head_weight().contiguous(), Tensor());
    replace_module("lm_head", merged);
    lm_head_ = merged;
    lm_head_adapter_.reset();
  }
}

namespace {

// transformers' find_packed_sequence_indices: the document index of each
// token ([batch, tokens]), a new one wherever a position is not the previous
// one plus 1; then [batch, 1, tokens, tokens] true where query and key are
// in the same document (the causal part is the attention's own).
Tensor packed_document_mask(const Tensor& positions, int64_t B) {
  const int64_t T = positions.size(1);
  Tensor p = positions.size(0) == B ? positions : expand(positions, {B, T});
  const Tensor step = sub(slice(p, 1, 1, T), slice(p, 1, 0, T - 1));
  const Tensor starts = cat({zeros({B, 1}, {.dtype = DType::i64, .device = p.device()}),
                             ne(step, ones_like(step)).to(DType::i64)},
                            1);
  const Tensor document = cumsum(starts, 1);
  return unsqueeze(eq(unsqueeze(document, 2), unsqueeze(document, 1)), 1);
}

}  // namespace

Tensor CausalLM::hidden_states(const Tensor& ids, KVCache* cache, const Tensor& attention_mask,
                               const Tensor& position_ids) {
  const DecoderConfig& c = config_;
  if (!deferred_.empty())
    throw std::logic_error("[CausalLM] " + std::to_string(deferred_.size()) +
                           " weights are still in their files, " + deferred_.front() +
                           " first (apply_qlora reads them as it converts the layers; "
                           "read_deferred_weights reads them all)");
  if (!ids.defined() || ids.dtype() != DType::i64 || ids.dim() != 2)
    throw std::invalid_argument("[CausalLM] ids must be i64 [batch, tokens]" +
                                (ids.defined() ? ", got " + std::string(dtype_name(ids.dtype())) +
                                                     " " + shape_str(ids.shape())
                                               : std::string()));
  const int64_t B = ids.size(0), T = ids.size(1);
  const int64_t past = cache ? cache->length() : 0;
  if (past + T > c.max_position_embeddings)
    throw std::invalid_argument("[CausalLM] " + std::to_string(past + T) +
                                " positions exceed max_position_embeddings " +
                                std::to_string(c.max_position_embeddings));
  const Device dev = device();
  Tensor mask;
  if (attention_mask.defined()) {
    if (attention_mask.dim() != 2 || attention_mask.size(0) != B ||
        attention_mask.size(1) != past + T)
      throw std::invalid_argument("[CausalLM] attention_mask must be [" + std::to_string(B) + ", " +
                                  std::to_string(past + T) + "] (batch, cached + new), got " +
                                  shape_str(attention_mask.shape()));
    const Tensor keep = attention_mask.dtype() == DType::boolean
                            ? attention_mask
                            : ne(attention_mask, zeros_like(attention_mask));
    mask = reshape(keep.to(dev), {B, 1, 1, past + T});
  }
  // Given positions are the caller's; without them a step's are past ..
  // past + T - 1, whose tables are rows of shared ones (no launch).
  Tensor positions;
  if (position_ids.defined()) {
    if (position_ids.dtype() != DType::i64 || position_ids.dim() != 2 ||
        (position_ids.size(0) != B && position_ids.size(0) != 1) || position_ids.size(1) != T)
      throw std::invalid_argument("[CausalLM] position_ids must be i64 [" + std::to_string(B) +
                                  " or 1, " + std::to_string(T) + "], got " +
                                  std::string(dtype_name(position_ids.dtype())) + " " +
                                  shape_str(position_ids.shape()));
    positions = position_ids.to(dev);
    if (!cache && !mask.defined() && T > 1) mask = packed_document_mask(positions, B);
  }
  // The frequencies depend on transformers' largest position + 1 (dynamic
  // and longrope scaling), which given positions (packed documents restart
  // theirs) may be less than past + T.
  const auto tables = [&](const RopeConfig& rope) {
    if (!position_ids.defined())
      return sequence_rope_tables(rope_frequencies(rope, past + T), past, T, c.dtype, dev);
    if (positions.numel() == 0)
      return rope_tables(rope_frequencies(rope, past + T), positions, c.dtype);
    if (rope.scaling.type == "longrope") {
      // Short or long, chosen on the device as transformers' torch.where
      // chooses: no read back, so a captured step can hold it.
      const RopeTables shorter = rope_tables(rope_frequencies(rope, 0), positions, c.dtype);
      const RopeTables longer = rope_tables(rope_frequencies(rope, kMaxLength), positions, c.dtype);
      const Tensor past_original =
          gt(max(positions.to(DType::f64)),
             full({}, double(rope.scaling.original_max_position_embeddings - 1),
                  {.dtype = DType::f64, .device = dev}));
      return RopeTables{where(past_original, longer.cos, shorter.cos),
                        where(past_original, longer.sin, shorter.sin)};
    }
    if (rope.scaling.type == "dynamic") {  // a theta per length: read on the host
      const std::vector<int64_t> p =
          position_ids.to(Device::cpu()).contiguous().to_vector<int64_t>();
      return rope_tables(rope_frequencies(rope, *std::max_element(p.begin(), p.end()) + 1),
                         positions, c.dtype);
    }
    return rope_tables(rope_frequencies(rope, past + T), positions, c.dtype);
  };
  const RopeTables rope = tables(c.rope);
  // Gemma 3's sliding layers rotate with their own base.
  std::optional<RopeTables> local_rope;
  if (c.sliding_rope) local_rope = tables(*c.sliding_rope);
  Tensor h = embed_tokens_adapter_ ? embed_tokens_adapter_->lookup(embed_->weight(), ids.to(dev),
                                                                   embed_->padding_idx())
                                   : embed_->forward(ids.to(dev));
  // Gemma: times sqrt(hidden_size) rounded to the model's dtype, as
  // transformers' scaled embedding multiplies in that dtype.
  if (c.gemma_norms)
    h = mul(h, full({}, std::sqrt(static_cast<double>(c.hidden_size)),
                    {.dtype = c.dtype, .device = dev}));
  if (neftune_alpha_ > 0 && is_training()) {
    // transformers' hook: T the padded length, d the width.
    const double bound = neftune_alpha_ / std::sqrt(static_cast<double>(h.size(1) * h.size(2)));
    const Tensor noise = empty_like(h);
    uniform_(noise, -bound, bound, neftune_gen_);
    h = add(h, noise);
  }
  h = times_multiplier(h, c.embedding_multiplier);  // Granite's
  for (size_t l = 0; l < layers_.size(); ++l) {
    auto& layer = static_cast<DecoderLayer&>(*layers_[l]);
    const RopeTables& layer_rope =
        local_rope && c.layer_slides(static_cast<int64_t>(l)) ? *local_rope : rope;
    // Inside the layer's forward hooks, in the recomputation too (a sharded
    // base is gathered there).
    if (recompute_layers_ && !cache) {
      h = quanta::recompute(
          [&layer, layer_rope, l, mask](const Tensor& x) {
            const Module::ForwardScope scope(layer);
            return layer.forward(x, layer_rope, nullptr, l, mask);
          },
          h, layer.parameters(), layer.random_streams());
    } else {
      const Module::ForwardScope scope(layer);
      h = layer.forward(h, layer_rope, cache, l, mask);
    }
  }
  return norm_->forward(h);
}

void CausalLM::set_neftune_noise(double alpha, uint64_t seed) {
  if (!(alpha >= 0) || !std::isfinite(alpha))
    throw std::invalid_argument("neftune_noise_alpha must be a finite number >= 0, got " +
                                std::to_string(alpha));
  neftune_alpha_ = alpha;
  neftune_gen_ = Generator::named(seed, "neftune");
  neftune_gen_.set_replayable();  // the model's own: a captured step redraws from it
}

std::vector<Generator*> CausalLM::own_random_streams() {
  if (neftune_alpha_ > 0) return {&neftune_gen_};
  return {};
}

std::vector<std::string> CausalLM::layer_names() const {
  std::vector<std::string> names;
  for (size_t l = 0; l < layers_.size(); ++l)
    names.push_back(config_.decoder_module() + ".layers." + std::to_string(l));
  return names;
}

Tensor CausalLM::logits(const Tensor& ids, KVCache* cache, const Tensor& attention_mask,
                        const Tensor& position_ids) {
  return softcap_logits(scale_logits(linear(hidden_states(ids, cache, attention_mask, position_ids),
                                            lm_head_weight()),
                                     config_.logits_scaling),
                        config_.final_logit_softcapping);
}

Tensor CausalLM::lm_loss(const Tensor& hidden, const Tensor& labels, int64_t chunk_tokens) const {
  LmLossOptions o;
  o.chunk_tokens = chunk_tokens;
  o.logit_softcap = config_.final_logit_softcapping;
  o.logit_divisor = config_.logits_scaling;
  // With trainable tokens, their rows' gradient alone: the output weight
  // (their rows written in) is a constant of the loss, made without a graph.
  o.trained_rows = lm_head_trained_rows();
  o.trained_values = lm_head_trained_values();
  Tensor weight;
  {
    std::optional<NoGradGuard> constant;
    if (o.trained_rows.defined()) constant.emplace();
    weight = lm_head_weight();
  }
  return chunked_causal_lm_loss(hidden, weight, labels, o);
}

}  // namespace quanta::llm
