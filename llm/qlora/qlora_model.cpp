#include "llm/qlora/qlora_model.h"

#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/text.h"
#include "llm/qlora/lora_targets.h"
#include "quant/nf4/nf4_interop.h"

namespace quanta::llm {

namespace {

// transformers keeps the output projection in the model's dtype under
// load_in_4bit (llm_int8_skip_modules), and PEFT's all-linear skips it.
constexpr const char* kOutputLayer = "lm_head";

// A child slot of the model tree: the parent, the child's name and its full
// dotted name. Collected before replacing, since replacing while walking
// would invalidate the walk.
template <typename Child>
struct Slot {
  Module* parent;
  std::string child, name;
  Child* module;
};

template <typename Child>
std::vector<Slot<Child>> find_children(Module& root) {
  std::vector<Slot<Child>> out;
  for (auto& [prefix, m] : root.named_modules())
    for (auto& [child, c] : m->named_children())
      if (auto* typed = dynamic_cast<Child*>(c.get()))
        out.push_back({m, child, prefix.empty() ? child : prefix + "." + child, typed});
  return out;
}

// A linear layer apply_qlora converts: a float Linear to quantize, or an
// NF4 base loaded already (a 4-bit folder) that only gets its adapter.
struct Convertible {
  Module* parent;
  std::string child, name;
  Linear* linear = nullptr;
  quant::NF4Linear* nf4 = nullptr;
  int64_t in() const { return linear ? linear->in_features() : nf4->in_features(); }
  int64_t out() const { return linear ? linear->out_features() : nf4->out_features(); }
};

// The modules modules_to_save names (PEFT's rule, saved_module): leaf
// modules that are not linear layers to quantize, lm_head aside. Throws for
// an entry that matches nothing or something quanta cannot train whole.
std::vector<std::string> find_saved_modules(CausalLM& model, const LoraSettings& l) {
  std::vector<std::string> out;
  for (const std::string& entry : l.modules_to_save) {
    bool found = false;
    for (auto& [name, m] : model.named_modules()) {
      if (name.empty() || !saved_module({entry}, name)) continue;
      const std::string where = "modules_to_save entry \"" + entry + "\" names " + name;
      if (dynamic_cast<quant::NF4Linear*>(m) || dynamic_cast<quant::LoRALinear*>(m) ||
          (dynamic_cast<Linear*>(m) && !ends_with_part(name, kOutputLayer)))
        throw std::invalid_argument(where +
                                    ", a linear layer quantized to NF4 (give it an adapter "
                                    "through target_modules instead)");
      if (!m->named_children().empty())
        throw std::invalid_argument(where +
                                    ", which holds other modules (name the embeddings, lm_head "
                                    "or norms: embed_tokens, lm_head, norm)");
      if (model.config().tie_word_embeddings && ends_with_part(name, "embed_tokens"))
        throw std::invalid_argument(where +
                                    ", the embeddings of a model with tie_word_embeddings: "
                                    "quanta does not train tied embeddings whole");
      found = true;
      if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
    }
    if (!found)
      throw std::invalid_argument(
          "modules_to_save entry \"" + entry + "\" matches no module of the model" +
          (model.config().tie_word_embeddings && entry == kOutputLayer
               ? " (its embeddings are tied: the output layer is model.embed_tokens)"
               : " (they end in embed_tokens, lm_head, norm, input_layernorm, ...)"));
  }
  return out;
}

// `param` ("lm_head.weight") is a parameter of the module `module` itself.
bool parameter_of(const std::string& param, const std::string& module) {
  return param.size() > module.size() + 1 && param.starts_with(module) &&
         param[module.size()] == '.' && param.find('.', module.size() + 1) == std::string::npos;
}

std::shared_ptr<Module> child_of(Module& parent, const std::string& name) {
  for (auto& [n, c] : parent.named_children())
    if (n == name) return c;
  throw std::logic_error("[apply_qlora] no child " + name);
}

// apply_qlora's conversion, with adapters on o.lora.target_modules (none
// when it is empty).
QLoRAReport convert_layers(CausalLM& model, const QLoRAOptions& o) {
  quant::NF4Options nf4;
  nf4.block_size = o.quantization.blocksize;
  nf4.double_quant = o.quantization.double_quant;
  nf4.dequant_dtype = o.quantization.compute_dtype;
  quant::check_options(nf4);
  if (!find_children<quant::LoRALinear>(model).empty())
    throw std::invalid_argument("[apply_qlora] the model is already quantized and has adapters");

  QLoRAReport report;
  for (const Tensor& p : model.parameters()) report.total_parameters += p.numel();
  std::vector<Convertible> slots;
  for (const Slot<Linear>& s : find_children<Linear>(model))
    if (!ends_with_part(s.name, kOutputLayer))
      slots.push_back({s.parent, s.child, s.name, s.module});
  const std::vector<Slot<quant::NF4Linear>> loaded = find_children<quant::NF4Linear>(model);
  if (!loaded.empty() && !slots.empty())
    throw std::invalid_argument("[apply_qlora] the model is already quantized");
  for (const Slot<quant::NF4Linear>& s : loaded)
    slots.push_back({s.parent, s.child, s.name, nullptr, s.module});

  // Every setting must choose something, and each r must fit its layer:
  // checked before any layer is converted, so a refused model is unchanged.
  const bool adapters = !o.lora.target_modules.empty() || !o.lora.target_modules_regex.empty();
  std::vector<std::optional<LoraLayerSettings>> chosen(slots.size());
  if (adapters) {
    std::vector<std::string> names;
    for (const Convertible& s : slots) names.push_back(s.name);
    const UnusedLoraSettings unused = unused_lora_settings(o.lora, names);
    if (!unused.targets.empty())
      throw std::invalid_argument(join_names(unused.targets, "; ") +
                                  " (the model's linear layers end in q_proj, k_proj, v_proj, "
                                  "o_proj, gate_proj, up_proj, down_proj)");
    if (o.refuse_unused_settings && !unused.others.empty())
      throw std::invalid_argument(join_names(unused.others, "; "));
    bool any = false;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      chosen[i] = lora_layer_settings(o.lora, slots[i].name);
      any = any || chosen[i].has_value();
    }
    if (!any)
      throw std::invalid_argument(
          "no linear layer gets an adapter: exclude_modules or layers_to_transform leave none of "
          "the layers target_modules names");
  }
  report.saved_modules = find_saved_modules(model, o.lora);
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (chosen[i] && chosen[i]->r > std::min(slots[i].in(), slots[i].out()))
      throw std::invalid_argument("lora r " + std::to_string(chosen[i]->r) +
                                  " is larger than layer " + slots[i].name + " allows (" +
                                  std::to_string(slots[i].out()) + " x " +
                                  std::to_string(slots[i].in()) + ")");

  quant::LoRAOptions lora;
  lora.dropout = o.lora.lora_dropout;
  lora.use_rslora = o.lora.use_rslora;
  lora.use_dora = o.lora.use_dora;
  // What bitsandbytes dequantizes to: the dtype the weights were loaded in.
  lora.base_dtype = model.config().dtype == DType::f64 ? DType::f32 : model.config().dtype;
  lora.dtype = model.config().dtype == DType::f64 ? DType::f64 : DType::f32;
  lora.seed = o.seed;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const Convertible& s = slots[i];
    QLoRALayer layer{s.name, Shape{s.out(), s.in()}};
    std::shared_ptr<quant::NF4Linear> base;
    if (s.linear) {
      layer.bytes_before = s.linear->weight().nbytes();
      const Tensor bias = s.linear->bias().defined() ? s.linear->bias().detach() : Tensor();
      base = std::make_shared<quant::NF4Linear>(
          quant::quantize_bnb(s.linear->weight().detach(), nf4), bias, nf4.dequant_dtype);
      base->to(s.linear->weight().device());  // bitsandbytes' layout is built on the host
    } else {
      base = std::dynamic_pointer_cast<quant::NF4Linear>(child_of(*s.parent, s.child));
      layer.bytes_before = std::size_t(s.out() * s.in()) * element_size(model.config().dtype);
    }
    layer.bytes_after = base->weight_bytes();
    std::shared_ptr<Module> replacement = base;
    if (chosen[i]) {
      lora.rank = chosen[i]->r;
      lora.alpha = chosen[i]->lora_alpha;
      lora.stream = s.name;
      replacement = std::make_shared<quant::LoRALinear>(base, lora);
      layer.adapted = true;
    }
    s.parent->replace_module(s.child, replacement);
    report.layers.push_back(layer);
  }
  // Only the adapters train, and the modules trained whole.
  for (auto& [name, p] : model.named_parameters()) {
    bool trains = ends_with_part(name, "lora_A") || ends_with_part(name, "lora_B") ||
                  ends_with_part(name, "lora_magnitude_vector");
    for (const std::string& m : report.saved_modules) trains = trains || parameter_of(name, m);
    Tensor t = p;
    t.requires_grad_(trains);
    if (trains) report.trainable_parameters += p.numel();
  }
  return report;
}

}  // namespace

QLoRAReport apply_qlora(CausalLM& model, const QLoRAOptions& o) {
  check_lora_settings(o.lora);
  return convert_layers(model, o);
}

QLoRAReport quantize_base(CausalLM& model, const BaseQuantization& quantization) {
  QLoRAOptions o;
  o.lora.target_modules = {};
  o.quantization = quantization;
  return convert_layers(model, o);
}

std::vector<std::pair<std::string, quant::LoRALinear*>> lora_layers(Module& model) {
  std::vector<std::pair<std::string, quant::LoRALinear*>> out;
  for (const Slot<quant::LoRALinear>& s : find_children<quant::LoRALinear>(model))
    out.emplace_back(s.name, s.module);
  return out;
}

std::vector<std::pair<std::string, quant::NF4Linear*>> nf4_layers(Module& model) {
  // named_modules() is in model order: an adapted layer comes right before
  // its base, which takes the layer's name.
  std::vector<std::pair<std::string, quant::NF4Linear*>> out;
  std::string last_lora;
  for (auto& [name, m] : model.named_modules()) {
    if (dynamic_cast<quant::LoRALinear*>(m)) last_lora = name;
    if (auto* nf4 = dynamic_cast<quant::NF4Linear*>(m))
      out.emplace_back(!last_lora.empty() && name == last_lora + ".base" ? last_lora : name, nf4);
  }
  return out;
}

io::TensorMap bnb_base_tensors(Module& model) {
  io::TensorMap out;
  for (const auto& [name, layer] : nf4_layers(model)) {
    quant::append_bnb_tensors(out, name + ".weight", layer->bnb_weight());
    if (layer->bias().defined()) out.emplace_back(name + ".bias", layer->bias().detach());
  }
  return out;
}

void load_bnb_base(Module& model, const std::map<std::string, Tensor>& tensors,
                   const std::string& source) {
  StateDict incoming;
  std::string problems;
  const auto note = [&](const std::string& p) { problems += (problems.empty() ? "" : "; ") + p; };
  for (const auto& [name, layer] : nf4_layers(model)) {
    const std::string key = name + ".weight";
    quant::BnbNF4State state;
    try {
      state = quant::read_bnb_tensors(tensors, key);
    } catch (const std::exception& e) {
      note(e.what());
      continue;
    }
    const quant::BnbNF4State mine = layer->bnb_weight();
    if (state.shape != mine.shape || state.blocksize != mine.blocksize ||
        state.double_quant != mine.double_quant) {
      note(key + " is " + shape_str(state.shape) + " block " + std::to_string(state.blocksize) +
           (state.double_quant ? " with" : " without") + " double quant, the model's " +
           shape_str(mine.shape) + " block " + std::to_string(mine.blocksize) +
           (mine.double_quant ? " with" : " without") + " double quant");
      continue;
    }
    // The layer's buffers, as its state dict names them.
    std::string prefix;
    for (auto& [full, t] : model.named_buffers())
      if (t.is_same(layer->weight())) prefix = full.substr(0, full.size() - 6);  // "weight"
    incoming.emplace_back(prefix + "weight", state.packed.to(mine.packed.device()));
    incoming.emplace_back(prefix + "weight_absmax", state.absmax.to(mine.absmax.device()));
    if (state.double_quant) {
      incoming.emplace_back(prefix + "weight_nested_absmax",
                            state.nested_absmax.to(mine.nested_absmax.device()));
      incoming.emplace_back(prefix + "weight_nested_quant_map",
                            state.nested_quant_map.to(mine.nested_quant_map.device()));
      incoming.emplace_back(prefix + "weight_nested_offset",
                            full({}, state.nested_offset, {.dtype = DType::f32}));
    }
  }
  if (!problems.empty())
    throw std::runtime_error(source + " does not hold this model's NF4 bases: " + problems);
  model.load_state_dict(incoming, /*strict=*/false);
}

void merge_qlora(CausalLM& model) {
  const DType dtype = model.config().dtype;
  NoGradGuard no_grad;
  const auto plain = [&](const Tensor& weight, const Tensor& bias) {
    return std::make_shared<Linear>(weight.to(dtype).contiguous(),
                                    bias.defined() ? bias.to(dtype).contiguous() : Tensor());
  };
  for (const Slot<quant::LoRALinear>& s : find_children<quant::LoRALinear>(model))
    s.parent->replace_module(s.child, plain(s.module->merged_weight(), s.module->base()->bias()));
  for (const Slot<quant::NF4Linear>& s : find_children<quant::NF4Linear>(model))
    s.parent->replace_module(s.child, plain(s.module->dequantized_weight(), s.module->bias()));
  for (auto& [name, p] : model.named_parameters()) {
    Tensor t = p;
    t.requires_grad_(false);
  }
}

}  // namespace quanta::llm
