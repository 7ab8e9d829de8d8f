#include "llm/qlora/qlora_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/parallel.h"
#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "engine/text.h"
#include "llm/model/model_folder.h"
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
  // Where the layer lives (found before a deferred weight is read onto the
  // host for its conversion): its 4-bit base goes there.
  Device device = Device::cpu();
  int64_t in() const { return linear ? linear->in_features() : nf4->in_features(); }
  int64_t out() const { return linear ? linear->out_features() : nf4->out_features(); }
  bool has_bias() const { return linear ? linear->bias().defined() : nf4->bias().defined(); }
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
               ? " (its embeddings are tied: the output layer is " + model.embed_tokens_name() + ")"
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

// The name PEFT saves the bias parameter `param` (quanta's name: "<layer>.bias"
// before conversion, "<layer>.base.bias" in an adapted layer after) under
// when `which` trains it: "<layer>.base_layer.bias" for an adapted layer's
// (PEFT's layer holds the original as "base_layer"), the name itself for
// another's with `all`; none when it does not train.
std::optional<std::string> peft_bias_name(const std::string& param,
                                          const std::set<std::string>& adapted,
                                          TrainedBiases which) {
  if (which == TrainedBiases::none || param == "bias" || !ends_with_part(param, "bias"))
    return std::nullopt;
  const std::string module = param.substr(0, param.size() - 5);  // without ".bias"
  if (adapted.count(module)) return module + ".base_layer.bias";
  if (module.ends_with(".base") && adapted.count(module.substr(0, module.size() - 5)))
    return module.substr(0, module.size() - 5) + ".base_layer.bias";
  if (which == TrainedBiases::all) return param;
  return std::nullopt;
}

// What apply_qlora will do, every setting checked, nothing changed yet.
struct ConversionPlan {
  quant::NF4Options nf4;
  std::vector<Convertible> slots;
  // Each slot's adapter settings; none where it gets no adapter.
  std::vector<std::optional<LoraLayerSettings>> chosen;
  // Trainable tokens by the module they change: CausalLM::embed_tokens_name(), "lm_head".
  std::vector<std::pair<std::string, std::vector<int64_t>>> tokens;
  QLoRAReport report;  // the totals and modules trained whole, so far
};

// The trainable tokens of `l` by the module they change (PEFT's rule: the
// list form is the input embeddings'; an object's keys are name suffixes;
// a tied model's output layer is the embeddings, taken once when its
// indices are theirs). Throws std::invalid_argument for what quanta or
// PEFT refuses.
std::vector<std::pair<std::string, std::vector<int64_t>>> token_modules(
    const CausalLM& model, const LoraSettings& l, const std::vector<std::string>& saved) {
  const int64_t vocab = model.config().vocab_size;
  const std::string embeddings = model.embed_tokens_name();
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& [key, indices] : l.trainable_token_indices) {
    std::string module;
    if (key.empty() || ends_with_part(embeddings, key))
      module = embeddings;
    else if (ends_with_part("lm_head", key))
      module = "lm_head";
    else
      throw std::invalid_argument("trainable_token_indices names \"" + key +
                                  "\", neither the embeddings (embed_tokens) nor the output "
                                  "layer (lm_head)");
    if (module == "lm_head" && model.config().tie_word_embeddings) {
      bool same = false;
      for (const auto& [k, i] : l.trainable_token_indices)
        same = same || ((k.empty() || ends_with_part(embeddings, k)) && i == indices);
      if (same) continue;
      throw std::invalid_argument(
          "trainable_token_indices on lm_head of a model with tie_word_embeddings: its output "
          "layer is the embeddings (give the indices to embed_tokens)");
    }
    for (const std::string& m : saved)
      if (m == module)
        throw std::invalid_argument("trainable_token_indices and modules_to_save both name " +
                                    module +
                                    " (PEFT refuses it too: train it whole or by rows, not both)");
    for (int64_t i : indices)
      if (i >= vocab)
        throw std::invalid_argument("trainable_token_indices: token " + std::to_string(i) +
                                    " is outside the vocabulary of " + std::to_string(vocab));
    for (const auto& [m, i] : out)
      if (m == module)
        throw std::invalid_argument("trainable_token_indices names " + module + " twice");
    out.emplace_back(module, indices);
  }
  return out;
}

// apply_qlora's plan, with adapters on o.lora.target_modules (none when it
// is empty). Throws std::invalid_argument for what apply_qlora refuses.
ConversionPlan plan_conversion(CausalLM& model, const QLoRAOptions& o) {
  ConversionPlan plan;
  quant::NF4Options& nf4 = plan.nf4;
  nf4.block_size = o.quantization.blocksize;
  nf4.double_quant = o.quantization.double_quant;
  nf4.dequant_dtype = o.quantization.compute_dtype;
  quant::check_options(nf4);
  if (!find_children<quant::LoRALinear>(model).empty())
    throw std::invalid_argument("[apply_qlora] the model is already quantized and has adapters");

  QLoRAReport& report = plan.report;
  for (const Tensor& p : model.parameters()) report.total_parameters += p.numel();
  std::vector<Convertible>& slots = plan.slots;
  for (const Slot<Linear>& s : find_children<Linear>(model))
    if (!ends_with_part(s.name, kOutputLayer))
      slots.push_back({s.parent, s.child, s.name, s.module, nullptr, s.module->weight().device()});
  const std::vector<Slot<quant::NF4Linear>> loaded = find_children<quant::NF4Linear>(model);
  if (!loaded.empty() && !slots.empty())
    throw std::invalid_argument("[apply_qlora] the model is already quantized");
  for (const Slot<quant::NF4Linear>& s : loaded)
    slots.push_back({s.parent, s.child, s.name, nullptr, s.module, s.module->weight().device()});

  // Every setting must choose something, and each r must fit its layer:
  // checked before any layer is converted, so a refused model is unchanged.
  const bool adapters = !o.lora.target_modules.empty() || !o.lora.target_modules_regex.empty();
  std::vector<std::optional<LoraLayerSettings>>& chosen = plan.chosen;
  chosen.resize(slots.size());
  if (adapters) {
    std::vector<std::string> names;
    for (const Convertible& s : slots) names.push_back(s.name);
    const UnusedLoraSettings unused = unused_lora_settings(o.lora, names);
    if (o.refuse_unmatched_targets && !unused.targets.empty()) {
      // The last parts of the layers' names, in model order, once each.
      std::vector<std::string> ends;
      for (const std::string& n : names) {
        const std::string end = n.substr(n.rfind('.') + 1);
        if (std::find(ends.begin(), ends.end(), end) == ends.end()) ends.push_back(end);
      }
      throw std::invalid_argument(join_names(unused.targets, "; ") +
                                  " (the model's linear layers end in " + join_names(ends, ", ") +
                                  ")");
    }
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
  if (!model.trainable_tokens().empty())
    throw std::invalid_argument("[apply_qlora] the model has trainable tokens already");
  plan.tokens = token_modules(model, o.lora, report.saved_modules);
  if (o.refuse_unused_settings && o.lora.bias != TrainedBiases::none) {
    bool any = false;
    if (o.lora.bias == TrainedBiases::all)
      for (auto& [name, p] : model.named_parameters()) any = any || ends_with_part(name, "bias");
    else
      for (std::size_t i = 0; i < slots.size(); ++i)
        any = any || (chosen[i] && slots[i].has_bias());
    if (!any)
      throw std::invalid_argument(
          std::string("bias \"") + trained_biases_name(o.lora.bias) + "\" trains nothing: " +
          (o.lora.bias == TrainedBiases::all ? "the model has no biases"
                                             : "no adapted layer has a bias") +
          " (a Llama's linear layers have none unless attention_bias or mlp_bias is set; "
          "Qwen2's q_proj, k_proj and v_proj have them)");
  }
  const LoraInit init = o.lora.init_lora_weights;
  if (init == LoraInit::loftq || init == LoraInit::pissa || init == LoraInit::corda)
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (chosen[i] && !slots[i].linear)
        throw std::invalid_argument(
            init == LoraInit::loftq
                ? "init_lora_weights loftq corrects the quantization error toward the float "
                  "weights, and layer " +
                      slots[i].name +
                      " was loaded in 4 bits (a 4-bit folder): start from the float model's folder"
                : std::string("init_lora_weights ") + lora_init_name(init) +
                      " takes its start out of the float weights and quantizes the residual, and "
                      "layer " +
                      slots[i].name +
                      " was loaded in 4 bits (a 4-bit folder): start from the float model's "
                      "folder (PEFT refuses it too)");
  for (const auto& [name, a] : o.given_lora_A) {
    std::size_t i = 0;
    while (i < slots.size() && slots[i].name != name) ++i;
    if (i == slots.size() || !chosen[i])
      throw std::invalid_argument("[apply_qlora] a lora_A is given for " + name +
                                  ", which is not an adapted layer");
    if (a.shape() != Shape{chosen[i]->r, slots[i].in()})
      throw std::invalid_argument("[apply_qlora] the lora_A given for " + name + " is " +
                                  shape_str(a.shape()) + ", its adapter's is " +
                                  shape_str(Shape{chosen[i]->r, slots[i].in()}));
  }
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (chosen[i] && chosen[i]->r > std::min(slots[i].in(), slots[i].out()))
      throw std::invalid_argument("lora r " + std::to_string(chosen[i]->r) +
                                  " is larger than layer " + slots[i].name + " allows (" +
                                  std::to_string(slots[i].out()) + " x " +
                                  std::to_string(slots[i].in()) + ")");

  return plan;
}

// A layer's PiSSA, OLoRA or CorDA start, with what its base is quantized from.
struct ResidualStartOf {
  quant::ResidualStart start;
  Tensor quantized;          // the residual, as the base's NF4 is made from it
  double error_before = -1;  // ||W - NF4(W)||^2 over float weights, else -1
};

// The quantization error ||W - NF4(W)||^2 of a float weight.
double squared_quantization_error(const Tensor& weight, const quant::NF4Linear& quantized,
                                  DType base_dtype) {
  const DType dtype = weight.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor host = weight.detach().to(Device::cpu()).to(dtype);
  return sum(square(host - quantized.dequantized_weight(base_dtype).to(Device::cpu()).to(dtype)))
      .item();
}

// What a start leaves: ||W - NF4(residual) - scaling B A||^2 against the
// error before it.
quant::QuantizationErrorChange start_error(const Tensor& weight, double before,
                                           const quant::LoRALinear& adapted) {
  NoGradGuard no_grad;
  const DType dtype = weight.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor host = weight.detach().to(Device::cpu()).to(dtype);
  const Tensor kept =
      adapted.base()->dequantized_weight(adapted.base_dtype()).to(Device::cpu()).to(dtype) +
      matmul(adapted.lora_B().to(Device::cpu()), adapted.lora_A().to(Device::cpu())).to(dtype) *
          adapted.scaling();
  return {before, sum(square(host - kept)).item()};
}

// The starts of slots `which` (each with chosen settings), decomposed at once.
std::vector<ResidualStartOf> residual_starts(
    const std::vector<Convertible>& slots,
    const std::vector<std::optional<LoraLayerSettings>>& chosen,
    const std::vector<std::size_t>& which, const QLoRAOptions& o, const quant::NF4Options& nf4,
    const quant::LoRAOptions& lora) {
  NoGradGuard no_grad;
  const bool pissa = o.lora.init_lora_weights == LoraInit::pissa;
  const bool corda = o.lora.init_lora_weights == LoraInit::corda;
  // PiSSA's and CorDA's residuals are formed from the float weights (what
  // PEFT's recipe saves in the model's dtype before bitsandbytes loads it).
  const bool from_float = pissa || corda;
  // PEFT leaves the start's factors in the layer's dtype: the model's.
  const DType factor_dtype = lora.base_dtype;
  std::vector<quant::ResidualStartLayer> layers;
  std::vector<ResidualStartOf> out(which.size());
  std::vector<Generator> gens;
  std::vector<Tensor> covariances;
  for (std::size_t k = 0; k < which.size(); ++k) {
    const Convertible& s = slots[which[k]];
    const LoraLayerSettings& c = *chosen[which[k]];
    const double scaling =
        o.lora.use_rslora ? c.lora_alpha / std::sqrt(double(c.r)) : c.lora_alpha / double(c.r);
    Tensor weight;
    if (from_float) {
      weight = s.linear->weight().detach().to(Device::cpu());
      // Its own stream per layer, as the adapters' other draws.
      if (pissa) gens.push_back(Generator::named(o.seed, "lora.pissa." + s.name));
      if (corda && o.stored_starts.empty()) covariances.push_back(o.corda_covariances.at(s.name));
    } else {
      // OLoRA as PEFT runs it over a bitsandbytes model: on the base as
      // quantized, dequantized to the model's dtype.
      std::shared_ptr<quant::NF4Linear> quantized;
      if (s.linear) {
        quantized = std::make_shared<quant::NF4Linear>(
            quant::quantize_bnb(s.linear->weight().detach(), nf4), Tensor(), nf4.dequant_dtype);
        out[k].error_before =
            squared_quantization_error(s.linear->weight(), *quantized, lora.base_dtype);
      }
      const quant::NF4Linear& base = s.linear ? *quantized : *s.nf4;
      weight = base.dequantized_weight(lora.base_dtype).to(Device::cpu());
    }
    layers.push_back({weight, c.r, scaling, factor_dtype});
  }
  std::vector<quant::ResidualStart> made;
  if (!o.stored_starts.empty()) {
    for (std::size_t k = 0; k < which.size(); ++k) {
      const auto it = o.stored_starts.find(slots[which[k]].name);
      if (it == o.stored_starts.end())
        throw std::invalid_argument("no stored start for layer " + slots[which[k]].name);
      made.push_back(quant::given_start(layers[k], it->second.first, it->second.second));
    }
  } else {
    made = pissa   ? quant::pissa_starts(layers, o.lora.pissa_niter, &gens)
           : corda ? quant::corda_starts(layers, covariances, o.lora.corda_config.method)
                   : quant::olora_starts(layers);
  }
  for (std::size_t k = 0; k < which.size(); ++k) {
    const Convertible& s = slots[which[k]];
    out[k].start = made[k];
    out[k].quantized = made[k].residual;  // OLoRA's is quantized from f32
    if (from_float) {
      // The residual is saved in the model's dtype before bitsandbytes
      // loads it.
      out[k].quantized = made[k].residual.to(s.linear->weight().dtype());
      const quant::NF4Linear whole(quant::quantize_bnb(s.linear->weight().detach(), nf4), Tensor(),
                                   nf4.dequant_dtype);
      out[k].error_before = squared_quantization_error(s.linear->weight(), whole, lora.base_dtype);
    }
  }
  return out;
}

// apply_qlora's conversion.
QLoRAReport convert_layers(CausalLM& model, const QLoRAOptions& o) {
  ConversionPlan plan = plan_conversion(model, o);
  const quant::NF4Options& nf4 = plan.nf4;
  const std::vector<Convertible>& slots = plan.slots;
  const std::vector<std::optional<LoraLayerSettings>>& chosen = plan.chosen;
  // Checked here, not in the plan: apply_qlora_corda plans first to find
  // the layers whose covariances it collects.
  if (o.lora.init_lora_weights == LoraInit::corda && o.stored_starts.empty())
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (chosen[i] && !o.corda_covariances.contains(slots[i].name))
        throw std::invalid_argument(
            "init_lora_weights corda decomposes each adapted layer's weight with the covariance "
            "of its inputs, and none is given for layer " +
            slots[i].name + " (apply_qlora_corda collects them from samples of the data)");
  QLoRAReport& report = plan.report;
  quant::LoRAOptions lora;
  lora.dropout = o.lora.lora_dropout;
  lora.use_rslora = o.lora.use_rslora;
  lora.use_dora = o.lora.use_dora;
  lora.lora_bias = o.lora.lora_bias;
  // What bitsandbytes dequantizes to: the dtype the weights were loaded in.
  lora.base_dtype = model.config().dtype == DType::f64 ? DType::f32 : model.config().dtype;
  lora.dtype = model.config().dtype == DType::f64 ? DType::f64 : DType::f32;
  lora.seed = o.seed;
  switch (o.lora.init_lora_weights) {
    case LoraInit::gaussian:
      lora.init = quant::LoRAInit::gaussian;
      break;
    case LoraInit::both_random:
      lora.init = quant::LoRAInit::both_random;
      break;
    case LoraInit::orthogonal:
      lora.init = quant::LoRAInit::orthogonal;
      break;
    case LoraInit::kaiming_uniform:
    case LoraInit::eva:    // replaced by given_lora_A where given
    case LoraInit::loftq:  // drawn, then replaced by the start
    case LoraInit::pissa:
    case LoraInit::olora:
    case LoraInit::corda:
      lora.init = quant::LoRAInit::kaiming_uniform;
      break;
  }
  // Each decoder layer's slots left to finish, for on_layer_converted: a
  // slot is finished when replaced, or for LoftQ when its correction ran.
  const std::vector<std::string> decoder_layers = model.layer_names();
  std::vector<std::size_t> layer_of(slots.size(), decoder_layers.size());
  std::vector<std::size_t> unfinished(decoder_layers.size(), 0);
  for (std::size_t i = 0; i < slots.size(); ++i)
    for (std::size_t l = 0; l < decoder_layers.size(); ++l)
      if (slots[i].name.starts_with(decoder_layers[l] + ".")) {
        layer_of[i] = l;
        ++unfinished[l];
      }
  std::size_t next_announced = 0;
  const auto finished = [&](std::size_t slot) {
    if (layer_of[slot] < unfinished.size()) --unfinished[layer_of[slot]];
    while (o.on_layer_converted && next_announced < unfinished.size() &&
           unfinished[next_announced] == 0)
      o.on_layer_converted(decoder_layers[next_announced++]);
  };
  // LoftQ's layers with their float weights, decomposed a thread's worth
  // at a time (each error is a layer's size on the host).
  std::vector<std::pair<quant::LoRALinear*, Tensor>> loftq;
  std::vector<std::size_t> loftq_layers, loftq_slots;
  const auto run_loftq = [&] {
    const std::vector<quant::QuantizationErrorChange> errors = quant::loftq_init(loftq);
    for (std::size_t j = 0; j < errors.size(); ++j)
      report.layers[loftq_layers[j]].quantization_error = errors[j];
    loftq.clear();
    loftq_layers.clear();
    for (std::size_t slot : loftq_slots) finished(slot);
    loftq_slots.clear();
  };
  // PiSSA's and OLoRA's starts, a thread's worth of layers decomposed at a
  // time, before those layers' bases are quantized from the residuals.
  std::vector<std::optional<ResidualStartOf>> starts(slots.size());
  const auto make_starts = [&](std::size_t first) {
    const std::size_t last = std::min(slots.size(), first + std::size_t(num_threads()));
    std::vector<std::size_t> which;
    for (std::size_t j = first; j < last; ++j)
      if (chosen[j]) {
        model.read_deferred_weights(slots[j].name, Device::cpu());
        which.push_back(j);
      }
    const std::vector<ResidualStartOf> made = residual_starts(slots, chosen, which, o, nf4, lora);
    for (std::size_t k = 0; k < which.size(); ++k) starts[which[k]] = made[k];
  };
  const bool from_base = takes_start_from_base(o.lora.init_lora_weights);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const Convertible& s = slots[i];
    if (from_base && i % std::size_t(num_threads()) == 0) make_starts(i);
    QLoRALayer layer{s.name, Shape{s.out(), s.in()}};
    std::shared_ptr<quant::NF4Linear> base;
    const Device device = s.device;
    // A weight left in its file (LoadOptions::defer_layer_weights) comes to
    // the host now, and goes with the float layer once it is replaced.
    if (s.linear) model.read_deferred_weights(s.name, Device::cpu());
    if (s.linear) {
      layer.bytes_before = s.linear->weight().nbytes();
    } else {
      base = std::dynamic_pointer_cast<quant::NF4Linear>(child_of(*s.parent, s.child));
      layer.bytes_before = std::size_t(s.out() * s.in()) * element_size(model.config().dtype);
    }
    if (s.linear || starts[i]) {
      const Tensor bias = s.linear
                              ? (s.linear->bias().defined() ? s.linear->bias().detach() : Tensor())
                              : (s.nf4->bias().defined() ? s.nf4->bias().detach() : Tensor());
      // bitsandbytes' layout is built on the host.
      const Tensor weight = starts[i] ? starts[i]->quantized : s.linear->weight().detach();
      base = std::make_shared<quant::NF4Linear>(quant::quantize_bnb(weight, nf4), bias,
                                                nf4.dequant_dtype);
      base->to(device);
    }
    layer.bytes_after = base->weight_bytes();
    std::shared_ptr<Module> replacement = base;
    if (chosen[i]) {
      lora.rank = chosen[i]->r;
      lora.alpha = chosen[i]->lora_alpha;
      lora.stream = s.name;
      auto adapted = std::make_shared<quant::LoRALinear>(base, lora);
      if (o.lora.init_lora_weights == LoraInit::loftq) {
        loftq.emplace_back(adapted.get(), s.linear->weight().detach());
        loftq_layers.push_back(report.layers.size());
        loftq_slots.push_back(i);
      }
      if (const auto given = o.given_lora_A.find(s.name); given != o.given_lora_A.end())
        adapted->set_adapters(given->second, adapted->lora_B());
      if (starts[i]) {
        const quant::ResidualStart& start = starts[i]->start;
        adapted->set_adapters(start.lora_A, start.lora_B);
        adapted->set_initial_adapters(start.taken_A, start.taken_B);
        if (s.linear)
          layer.quantization_error =
              start_error(s.linear->weight(), starts[i]->error_before, *adapted);
        starts[i].reset();
      }
      replacement = adapted;
      layer.adapted = true;
    }
    s.parent->replace_module(s.child, replacement);
    report.layers.push_back(layer);
    const bool corrected_later = !loftq_slots.empty() && loftq_slots.back() == i;
    if (loftq.size() == std::size_t(num_threads())) run_loftq();
    if (!corrected_later) finished(i);
  }
  if (!loftq.empty()) run_loftq();
  if (!model.deferred_weights().empty())
    throw std::logic_error("[apply_qlora] weight " + model.deferred_weights().front() +
                           " was left in its file: no layer converted holds it");
  for (const auto& [module, indices] : plan.tokens) model.add_trainable_tokens(module, indices);
  // Only the adapters train, the biases lora.bias names, the trainable
  // tokens and the modules trained whole.
  const std::vector<std::pair<std::string, Tensor>> biases = trained_biases(model, o.lora.bias);
  for (auto& [name, p] : model.named_parameters()) {
    bool trains = ends_with_part(name, "lora_A") || ends_with_part(name, "lora_B") ||
                  ends_with_part(name, "lora_B_bias") ||
                  ends_with_part(name, "trainable_tokens_delta") ||
                  ends_with_part(name, "lora_magnitude_vector");
    for (const std::string& m : report.saved_modules) trains = trains || parameter_of(name, m);
    for (const auto& [peft_name, b] : biases) trains = trains || b.is_same(p);
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

std::vector<std::pair<std::string, Tensor>> trained_biases(Module& model, TrainedBiases which) {
  std::set<std::string> adapted;
  for (const auto& [name, layer] : lora_layers(model)) adapted.insert(name);
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : model.named_parameters())
    if (const std::optional<std::string> peft = peft_bias_name(name, adapted, which))
      out.emplace_back(*peft, p);
  return out;
}

std::vector<std::pair<std::string, Shape>> planned_trained_tensors(CausalLM& model,
                                                                   const QLoRAOptions& o) {
  check_lora_settings(o.lora);
  const ConversionPlan plan = plan_conversion(model, o);
  std::vector<std::pair<std::string, Shape>> out;
  std::set<std::string> adapted;
  for (std::size_t i = 0; i < plan.slots.size(); ++i) {
    if (!plan.chosen[i]) continue;
    const Convertible& s = plan.slots[i];
    adapted.insert(s.name);
    for (const auto& [which, shape] :
         quant::LoRALinear::adapter_tensor_shapes(s.in(), s.out(),
                                                  {.rank = plan.chosen[i]->r,
                                                  .use_dora = o.lora.use_dora,
                                                  .lora_bias = o.lora.lora_bias}))
      out.emplace_back(s.name + "." + which, shape);
  }
  std::set<std::string> listed;
  for (auto& [name, p] : model.named_parameters())
    if (const std::optional<std::string> peft = peft_bias_name(name, adapted, o.lora.bias)) {
      out.emplace_back(*peft, p.shape());
      listed.insert(*peft);
    }
  for (const auto& [module, indices] : plan.tokens)
    out.emplace_back(module + "." + kTokenAdapterParameter,
                     Shape{int64_t(indices.size()), model.config().hidden_size});
  for (auto& [name, p] : model.named_parameters())
    for (const std::string& m : plan.report.saved_modules)
      if (parameter_of(name, m) && listed.insert(name).second) out.emplace_back(name, p.shape());
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

void check_qlora_mergeable(Module& model) {
  for (const auto& [name, layer] : lora_layers(model))
    if (layer->lora_B_bias().defined() && !layer->base()->bias().defined())
      throw std::invalid_argument(
          name +
          " has lora_bias but no bias of its own: a merged model has nowhere to hold it (PEFT "
          "refuses to merge it too; use the adapters unmerged)");
}

void merge_qlora(CausalLM& model) {
  check_qlora_mergeable(model);
  model.merge_trainable_tokens();
  const DType dtype = model.config().dtype;
  NoGradGuard no_grad;
  const auto plain = [&](const Tensor& weight, const Tensor& bias) {
    return std::make_shared<Linear>(weight.to(dtype).contiguous(),
                                    bias.defined() ? bias.to(dtype).contiguous() : Tensor());
  };
  for (const Slot<quant::LoRALinear>& s : find_children<quant::LoRALinear>(model))
    s.parent->replace_module(s.child, plain(s.module->merged_weight(), s.module->merged_bias()));
  for (const Slot<quant::NF4Linear>& s : find_children<quant::NF4Linear>(model))
    s.parent->replace_module(s.child, plain(s.module->dequantized_weight(), s.module->bias()));
  for (auto& [name, p] : model.named_parameters()) {
    Tensor t = p;
    t.requires_grad_(false);
  }
}

void save_merged_causal_lm(CausalLM& model, const std::string& dir, const StateDict& beside,
                           const SaveOptions& options,
                           const std::function<Tensor(const std::string&)>& float_base) {
  check_qlora_mergeable(model);
  model.merge_trainable_tokens();
  const DType dtype = model.config().dtype;
  // The tensors of each merged layer, made when written, as merge_qlora's
  // plain Linear holds them (weight, then bias).
  std::map<std::string, std::vector<io::TensorSource>> merged;
  const auto in_dtype = [dtype](std::function<Tensor()> make) {
    return [dtype, make = std::move(make)] {
      NoGradGuard no_grad;
      return make().to(dtype).contiguous();
    };
  };
  const auto add_layer = [&](const std::string& layer, const quant::NF4Linear& base,
                             std::function<Tensor()> weight, std::function<Tensor()> bias) {
    std::vector<io::TensorSource>& out = merged[layer];
    out.push_back({layer + ".weight",
                   dtype,
                   {base.out_features(), base.in_features()},
                   in_dtype(std::move(weight))});
    if (bias) out.push_back({layer + ".bias", dtype, {base.out_features()}, in_dtype(bias)});
  };
  // The merged layer a state-dict name lies in, or none.
  const auto layer_of = [&merged](const std::string& name) -> const std::string* {
    for (const auto& [layer, tensors] : merged)
      if (name.size() > layer.size() && name.starts_with(layer) && name[layer.size()] == '.')
        return &layer;
    return nullptr;
  };
  for (const Slot<quant::LoRALinear>& s : find_children<quant::LoRALinear>(model)) {
    const quant::LoRALinear* l = s.module;
    const bool has_bias = l->base()->bias().defined() || l->lora_B_bias().defined();
    std::function<Tensor()> weight = [l] { return l->merged_weight(); };
    if (float_base)
      weight = [l, &float_base, name = s.name + ".weight"] {
        return l->merged_weight(float_base(name));
      };
    add_layer(s.name, *l->base(), std::move(weight),
              has_bias ? std::function<Tensor()>([l] { return l->merged_bias(); }) : nullptr);
  }
  for (const Slot<quant::NF4Linear>& s : find_children<quant::NF4Linear>(model)) {
    if (layer_of(s.name)) continue;  // an adapted layer's base
    const quant::NF4Linear* n = s.module;
    std::function<Tensor()> weight = [n] { return n->dequantized_weight(); };
    if (float_base) weight = [&float_base, name = s.name + ".weight"] { return float_base(name); };
    add_layer(s.name, *n, std::move(weight),
              n->bias().defined() ? std::function<Tensor()>([n] { return n->bias(); }) : nullptr);
  }
  // In the merged model's order: a merged layer's tensors where its first
  // one was (the order save_pretrained shards by).
  std::vector<io::TensorSource> weights;
  std::set<std::string> placed;
  for (const auto& [name, t] : model.state_dict()) {
    const std::string* layer = layer_of(name);
    if (!layer) {
      weights.push_back(io::tensor_sources({{name, t}})[0]);
    } else if (placed.insert(*layer).second) {
      const std::vector<io::TensorSource>& tensors = merged.at(*layer);
      weights.insert(weights.end(), tensors.begin(), tensors.end());
    }
  }
  save_causal_lm_streamed(model.config(), dir, weights, beside, options);
}

}  // namespace quanta::llm
