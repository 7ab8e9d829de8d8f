// save_bnb_folder: the NF4 states from bnb_base_tensors, the unquantized
// weights by transformers' names, and config.json plus quantization_config.
#include "llm/qlora/bnb_folder.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "engine/io/atomic_file.h"
#include "engine/io/safetensors.h"
#include "llm/model/config.h"
#include "llm/qlora/qlora_model.h"

namespace quanta::llm {

namespace fs = std::filesystem;
using nlohmann::json;

void save_bnb_folder(CausalLM& model, const BaseQuantization& quantization,
                     const std::string& dir) {
  io::TensorMap tensors = bnb_base_tensors(model);
  if (tensors.empty())
    throw std::invalid_argument(
        "[save_bnb_folder] the model has no NF4 layers (apply_qlora first)");
  std::set<std::string> quantized;
  for (const auto& [name, t] : tensors) quantized.insert(name);
  for (const auto& [name, shape] : CausalLM::expected_weights(model.config())) {
    if (quantized.count(name)) continue;
    const Tensor t = model.find(name);
    if (!t.defined()) throw std::logic_error("[save_bnb_folder] the model has no " + name);
    tensors.emplace_back(name, t.detach());
  }
  json config = json::parse(decoder_config_json(model.config()));
  // The fields BitsAndBytesConfig.to_dict gives for load_in_4bit NF4.
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
      {"llm_int8_skip_modules", nullptr},
      {"llm_int8_threshold", 6.0}};
  fs::create_directories(dir);
  io::write_text_atomic((fs::path(dir) / "config.json").string(), config.dump(2) + "\n",
                        "save_bnb_folder");
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
}

}  // namespace quanta::llm
