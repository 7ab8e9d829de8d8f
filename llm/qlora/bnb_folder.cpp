// save_bnb_folder: the NF4 states from bnb_base_tensors, the unquantized
// weights by transformers' names, and config.json plus quantization_config.
#include "llm/qlora/bnb_folder.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <tuple>

#include "engine/factory.h"
#include "engine/io/atomic_file.h"
#include "engine/io/safetensors.h"
#include "engine/ops/view.h"
#include "llm/model/config.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/qlora_model.h"
#include "quant/nf4/nf4_interop.h"
#include "quant/nf4/nf4_modules.h"

namespace quanta::llm {

namespace fs = std::filesystem;
using nlohmann::json;

void save_bnb_folder(CausalLM& model, const BaseQuantization& quantization, const std::string& dir,
                     const StateDict& beside, const SaveOptions& options) {
  const DecoderConfig& c = model.config();
  const bool image_text = !c.image_text_config.empty();
  if (image_text && beside.empty())
    throw std::invalid_argument(
        "[save_bnb_folder] an image-text model's 4-bit folder needs its vision tower and "
        "projector (read_non_decoder_weights of the folder it came from)");
  io::TensorMap tensors = bnb_base_tensors(model);
  if (tensors.empty())
    throw std::invalid_argument(
        "[save_bnb_folder] the model has no NF4 layers (apply_qlora first)");
  std::set<std::string> quantized;
  for (const auto& [name, t] : tensors) quantized.insert(name);
  for (const auto& [name, shape] : CausalLM::expected_weights(c)) {
    if (quantized.count(name)) continue;
    const Tensor t = model.find(name);
    if (!t.defined()) throw std::logic_error("[save_bnb_folder] the model has no " + name);
    tensors.emplace_back(name, t.detach());
  }
  // Under the names transformers stores them by (an image-text model's
  // decoder in the hub's layout), its vision tower beside.
  for (auto& [name, t] : tensors) name = stored_weight_name(c, name);
  for (const auto& [name, t] : beside) tensors.emplace_back(name, t);
  json config = json::parse(decoder_config_json(c));
  // The fields BitsAndBytesConfig.to_dict gives for load_in_4bit NF4; an
  // image-text model's vision tower and projector are left in their dtype
  // (module-name prefixes, which transformers 4.x and 5.x both match).
  json skipped = nullptr;
  if (image_text) {
    skipped = json::array();
    for (const char* module : kVisionModules) skipped.push_back(std::string("model.") + module);
    skipped.push_back("lm_head");
  }
  config["quantization_config"] = {
      {"quant_method", "bitsandbytes"},
      {"load_in_4bit", true},
      {"load_in_8bit", false},
      {"_load_in_4bit", true},
      {"_load_in_8bit", false},
      {"bnb_4bit_quant_type", "nf4"},
      {"bnb_4bit_use_double_quant", quantization.double_quant},
      {"bnb_4bit_compute_dtype", torch_dtype_name(quantization.compute_dtype)},
      {"bnb_4bit_quant_storage", "uint8"},
      {"llm_int8_enable_fp32_cpu_offload", false},
      {"llm_int8_has_fp16_weight", false},
      {"llm_int8_skip_modules", skipped},
      {"llm_int8_threshold", 6.0}};
  fs::create_directories(dir);
  write_model_weights(dir, io::tensor_sources(tensors), options, "save_bnb_folder");
  io::write_text_atomic((fs::path(dir) / "config.json").string(), config.dump(2) + "\n",
                        "save_bnb_folder");
}

std::optional<BaseQuantization> folder_quantization(const std::string& dir) {
  const std::string path = model_folder_file(dir, "config.json");
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  const json config = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object() || !config.contains("quantization_config")) return std::nullopt;
  const json& q = config["quantization_config"];
  const std::string method = q.value("quant_method", std::string("?"));
  if (method != "bitsandbytes" || !q.value("load_in_4bit", false) ||
      q.value("bnb_4bit_quant_type", std::string("fp4")) != "nf4")
    throw std::runtime_error(path + ": quantization_config is " + method +
                             (method == "bitsandbytes"
                                  ? (q.value("load_in_4bit", false)
                                         ? " " + q.value("bnb_4bit_quant_type", std::string("fp4"))
                                         : std::string(" 8-bit"))
                                  : std::string()) +
                             "; quanta reads bitsandbytes NF4 (load_in_4bit, nf4) folders");
  BaseQuantization b;
  b.double_quant = q.value("bnb_4bit_use_double_quant", false);
  const json dtype = q.value("bnb_4bit_compute_dtype", json("float32"));
  b.compute_dtype = dtype_from_torch_name(dtype.is_string() ? dtype.get<std::string>() : "float32");
  return b;
}

std::shared_ptr<CausalLM> load_bnb_folder(const std::string& dir, Device device,
                                          std::optional<DType> compute_dtype) {
  const std::optional<BaseQuantization> recorded = folder_quantization(dir);
  if (!recorded)
    throw std::invalid_argument(dir +
                                ": config.json has no quantization_config (a float folder: "
                                "load_causal_lm)");
  const DType dequant = compute_dtype.value_or(recorded->compute_dtype);
  const DecoderConfig config = read_decoder_config(model_folder_file(dir, "config.json"));
  std::map<std::string, Tensor> file;
  std::vector<std::string> names;
  // Under CausalLM's names; an image-text model's vision tower (quantized
  // or not) is not read.
  for (auto& [stored, t] : read_model_weights(dir, [&](const std::string& name) {
         return decoder_weight_name(config, name).has_value();
       })) {
    const std::string name = *decoder_weight_name(config, stored);
    names.push_back(name);
    file.emplace(name, t);
  }
  try {
    CausalLM::check_layer_count(config, names);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(dir + ": " + e.what());
  }
  // The layers stored as bitsandbytes states get a weight that takes no
  // memory (one zero, broadcast) until their NF4 base replaces them.
  StateDict weights;
  std::map<std::string, Shape> quantized;  // layer name -> its weight's shape
  for (const auto& [name, shape] : CausalLM::expected_weights(config)) {
    if (quant::has_bnb_tensors(file, name)) {
      quantized[name.substr(0, name.size() - 7)] = shape;  // less ".weight"
      weights.emplace_back(name, expand(zeros({1, 1}, {.dtype = config.dtype}), shape));
    } else if (file.count(name)) {
      weights.emplace_back(name, file.at(name));
    }
  }
  // A tied model's stored lm_head goes to CausalLM, which takes it only as
  // a copy of the embeddings.
  if (config.tie_word_embeddings && file.count("lm_head.weight"))
    weights.emplace_back("lm_head.weight", file.at("lm_head.weight"));
  std::shared_ptr<CausalLM> model;
  try {
    model = std::make_shared<CausalLM>(config, weights);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(dir + ": " + e.what());
  }
  // Each stored layer's parent and child name, found in one walk (replacing
  // while walking would invalidate the walk).
  std::vector<std::tuple<Module*, std::string, std::string>> slots;
  for (auto& [prefix, m] : model->named_modules())
    for (auto& [child, c] : m->named_children()) {
      const std::string name = prefix.empty() ? child : prefix + "." + child;
      if (quantized.count(name)) slots.emplace_back(m, child, name);
    }
  std::string problems;
  for (const auto& [parent, child, layer] : slots) {
    const Tensor bias = model->find(layer + ".bias");
    try {
      const quant::BnbNF4State state = quant::read_bnb_tensors(file, layer + ".weight");
      if (state.shape != quantized.at(layer))
        throw std::invalid_argument(layer + ".weight is " + shape_str(state.shape) +
                                    ", the config's " + shape_str(quantized.at(layer)));
      parent->replace_module(child, std::make_shared<quant::NF4Linear>(
                                        state, bias.defined() ? bias.detach() : Tensor(), dequant));
    } catch (const std::exception& e) {
      problems += std::string(problems.empty() ? "" : "; ") + e.what();
    }
  }
  if (!problems.empty()) throw std::invalid_argument(dir + ": " + problems);
  for (auto& [name, p] : model->named_parameters()) {
    Tensor t = p;
    t.requires_grad_(false);
  }
  if (!device.is_cpu()) model->to(device);
  return model;
}

std::shared_ptr<CausalLM> load_base_model(const std::string& dir, Device device,
                                          std::optional<DType> compute_dtype,
                                          const LoadOptions& options) {
  if (folder_quantization(dir)) return load_bnb_folder(dir, device, compute_dtype);
  return load_causal_lm(dir, device, options);
}

}  // namespace quanta::llm
