#include "llm/qlora/peft_folder.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string_view>

#include "engine/autograd/grad_mode.h"
#include "engine/io/atomic_file.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/lora_targets.h"

namespace quanta::llm {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

// What PEFT's saved names put before a module's name.
constexpr std::string_view kPeftPrefix = "base_model.model.";

// The last component of a path or hub id, without a trailing slash:
// "meta-llama/Llama-3.2-1B" and "/models/Llama-3.2-1B/" both give
// "Llama-3.2-1B".
std::string last_component(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

std::string peft_tensor_name(const std::string& module, const std::string& which) {
  return std::string(kPeftPrefix) + module + "." + which + ".weight";
}

std::vector<std::pair<std::string, Tensor>> peft_trained_parameters(Module& model,
                                                                    const LoraSettings& lora) {
  std::vector<std::pair<std::string, Tensor>> out;
  const auto add = [&](const std::string& name, const Tensor& t) {
    for (const auto& [n, held] : out)
      if (held.is_same(t)) return;  // a bias of a module also trained whole
    out.emplace_back(std::string(kPeftPrefix) + name, t);
  };
  for (const auto& [name, layer] : lora_layers(model))
    for (const auto& [which, t] : layer->adapter_tensors()) add(name + "." + which, t);
  for (const auto& [name, t] : trained_biases(model, lora.bias)) add(name, t);
  for (auto& [name, p] : model.named_parameters())
    if (name.ends_with(std::string(".") + kTokenAdapterParameter)) add(name, p);
  if (lora.modules_to_save.empty()) return out;
  for (auto& [name, p] : model.named_parameters()) {
    const std::size_t dot = name.rfind('.');
    if (dot == std::string::npos || !saved_module(lora.modules_to_save, name.substr(0, dot)))
      continue;
    if (name.find(".lora_") != std::string::npos) continue;  // an adapter's, listed above
    add(name, p);
  }
  return out;
}

io::TensorMap peft_adapter_tensors(Module& model, const LoraSettings& lora) {
  io::TensorMap out;
  for (const auto& [name, t] : peft_trained_parameters(model, lora))
    out.emplace_back(name, t.detach());
  return out;
}

namespace {

// PEFT's conversion of adapters trained from a start taken out of the base
// (subtract_mutated_init): W_res + s B A = W + s (B A - B0 A0)
// = W + s [B | -B0] [A; A0], a LoRA of twice the rank over the original
// weight. False when no layer kept a start.
bool convert_started_adapters(Module& model, io::TensorMap& tensors) {
  std::map<std::string, Tensor> converted;
  for (const auto& [layer, lora] : lora_layers(model)) {
    if (!lora->initial_lora_A().defined()) continue;
    NoGradGuard no_grad;
    const Device host = Device::cpu();
    converted[peft_tensor_name(layer, "lora_A")] =
        cat({lora->lora_A().detach().to(host), lora->initial_lora_A()}, 0);
    converted[peft_tensor_name(layer, "lora_B")] =
        cat({lora->lora_B().detach().to(host), -lora->initial_lora_B()}, 1);
  }
  if (converted.empty()) return false;
  for (auto& [name, t] : tensors)
    if (const auto it = converted.find(name); it != converted.end()) t = it->second;
  return true;
}

}  // namespace

void save_peft_adapters(Module& model, const LoraSettings& given,
                        const BaseQuantization& given_quantization, const std::string& dir) {
  io::TensorMap tensors = peft_adapter_tensors(model, given);
  if (tensors.empty())
    throw std::invalid_argument("[save_peft_adapters] the model has no adapters");
  LoraSettings lora = given;
  BaseQuantization quantization = given_quantization;
  if (convert_started_adapters(model, tensors)) {
    if (!takes_start_from_base(given.init_lora_weights))
      throw std::invalid_argument(
          std::string("[save_peft_adapters] the adapters kept a start taken out of the base, "
                      "and init_lora_weights is ") +
          lora_init_name(given.init_lora_weights) + ", not pissa, olora or corda");
    lora = converted_to_lora(given);
    quantization.start_taken_out = lora_init_text(given);
    quantization.start_lora_alpha = given.lora_alpha;
  }
  // An image-text model's adapters are its decoder's: PEFT is told to
  // leave the vision tower alone.
  const auto* lm = dynamic_cast<const CausalLM*>(&model);
  const bool image_text = lm && !lm->config().image_text_config.empty();
  const std::string config =
      adapter_config_json(image_text ? excluding_vision_modules(lora) : lora, quantization)
          .dump(2) +
      "\n";
  fs::create_directories(dir);
  io::save_safetensors((fs::path(dir) / kAdapterWeightsFile).string(), tensors, {{"format", "pt"}});
  io::write_text_atomic((fs::path(dir) / kAdapterConfigFile).string(), config,
                        "save_peft_adapters");
}

AdapterFolderConfig read_adapter_folder_config(const std::string& dir, DType model_dtype) {
  if (!fs::is_directory(dir))
    throw std::runtime_error(dir + ": not an adapter folder (no such folder)");
  const std::string path = model_folder_file(dir, kAdapterConfigFile);
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open (is " + dir + " a PEFT adapter folder?)");
  ojson j;
  try {
    j = ojson::parse(in);
  } catch (const ojson::exception& e) {
    throw std::runtime_error(path + ": not JSON (" + std::string(e.what()) + ")");
  }
  AdapterFolderConfig folder{read_adapter_config(j, path),
                             read_base_quantization(j, path, model_dtype)};
  if (!folder.quantization.start_taken_out.empty()) {
    try {
      folder.lora = trained_from_start(folder.lora, folder.quantization);
      check_lora_settings(folder.lora);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(path + ": " + e.what());
    }
  }
  return folder;
}

namespace {

// The folder's adapter_model.safetensors, read whole (sizes and offsets
// checked).
io::SafetensorsFile read_adapter_weights(const std::string& dir) {
  const std::string path = model_folder_file(dir, kAdapterWeightsFile);
  if (!fs::exists(path)) {
    // PEFT before safetensors became its default wrote a pickle.
    if (fs::exists(fs::path(dir) / "adapter_model.bin"))
      throw std::runtime_error(path +
                               ": no such file; the folder holds adapter_model.bin, PyTorch's "
                               "pickle, which quanta does not read (save the adapters again "
                               "with PEFT's save_pretrained, whose default is safetensors)");
    throw std::runtime_error(path + ": no such file");
  }
  return io::load_safetensors(path);
}

// Throws listing every misfit between `file` (read from `path`) and the
// tensors a model trains, by PEFT's name and shape: missing, unexpected,
// mis-shaped or not floating.
void check_adapter_file(const io::SafetensorsFile& file, const std::string& path,
                        const std::vector<std::pair<std::string, Shape>>& wanted) {
  std::map<std::string, const Tensor*> stored;
  for (const auto& [name, t] : file.tensors) stored[name] = &t;
  std::string problems;
  const auto note = [&](const std::string& p) { problems += (problems.empty() ? "" : "; ") + p; };
  std::map<std::string, bool> used;
  for (const auto& [name, t] : stored) used[name] = false;
  for (const auto& [name, shape] : wanted) {
    auto it = stored.find(name);
    if (it == stored.end()) {
      note("missing " + name);
      continue;
    }
    used[name] = true;
    if (it->second->shape() != shape)
      note(name + " is " + shape_str(it->second->shape()) + ", the model's is " + shape_str(shape));
    else if (!is_floating(it->second->dtype()))
      note(name + " is " + dtype_name(it->second->dtype()) + ", not floating");
  }
  for (const auto& [name, was_used] : used)
    if (!was_used) note("unexpected " + name);
  if (!problems.empty())
    throw std::runtime_error(path +
                             " does not fit the model (made for another base, r or "
                             "target_modules?): " +
                             problems);
}

// Copies `file` (read from `path`) into what the converted `model` trains,
// or throws listing every misfit with the model unchanged.
void copy_adapter_tensors(Module& model, const io::SafetensorsFile& file, const std::string& path,
                          const LoraSettings& lora) {
  const io::TensorMap wanted = peft_adapter_tensors(model, lora);
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const auto& [name, t] : wanted) shapes.emplace_back(name, t.shape());
  check_adapter_file(file, path, shapes);
  std::map<std::string, Tensor> stored(file.tensors.begin(), file.tensors.end());
  NoGradGuard no_grad;
  for (const auto& [name, t] : wanted) copy_(t, stored.at(name).to(t.dtype()).to(t.device()));
}

// Every stored lora_A must have the rank the config gives its layer (r, or
// its rank_pattern's): checked before adapters of that rank are made, so
// that a config's r of 10^9 allocates nothing.
void check_stored_rank(const io::SafetensorsFile& file, const LoraSettings& lora,
                       const std::string& path) {
  const std::string suffix = ".lora_A.weight";
  bool any = false;
  for (const auto& [name, t] : file.tensors) {
    if (name.find(".lora_A.") == std::string::npos) continue;
    any = true;
    // "base_model.model.<layer>.lora_A.weight"; a name of another form is
    // reported as unexpected when the tensors are copied.
    if (name.size() <= kPeftPrefix.size() + suffix.size() || !name.starts_with(kPeftPrefix) ||
        !name.ends_with(suffix))
      continue;
    const std::string layer =
        name.substr(kPeftPrefix.size(), name.size() - kPeftPrefix.size() - suffix.size());
    const std::optional<LoraLayerSettings> settings = lora_layer_settings(lora, layer);
    if (!settings) continue;  // unexpected, reported with the others
    if (t.dim() != 2 || t.size(0) != settings->r)
      throw std::runtime_error(path + ": " + name + " is " + shape_str(t.shape()) +
                               ": it has rank " +
                               (t.dim() == 2 ? std::to_string(t.size(0)) : std::string("?")) +
                               ", the config gives the layer r " + std::to_string(settings->r) +
                               " (an adapter_config.json from another run?)");
  }
  if (!any) throw std::runtime_error(path + " holds no lora_A tensor (not a LoRA adapter file)");
}

// A folder saved converted from a start taken out of the base holds each
// adapter as [B | -B0] and [A; A0]: the trained halves stay in `weights`, the
// starts (A0, B0) come back by layer name.
std::map<std::string, std::pair<Tensor, Tensor>> split_stored_starts(io::SafetensorsFile& weights,
                                                                     const std::string& path) {
  std::map<std::string, std::pair<Tensor, Tensor>> starts;
  for (auto& [name, t] : weights.tensors) {
    for (const char* which : {"lora_A", "lora_B"}) {
      const std::string suffix = std::string(".") + which + ".weight";
      if (!name.starts_with(kPeftPrefix) || !name.ends_with(suffix) ||
          name.size() <= kPeftPrefix.size() + suffix.size())
        continue;
      const std::string layer =
          name.substr(kPeftPrefix.size(), name.size() - kPeftPrefix.size() - suffix.size());
      const bool a = which == std::string("lora_A");
      const int64_t dim = a ? 0 : 1;
      if (t.dim() != 2 || t.shape()[dim] % 2 != 0)
        throw std::runtime_error(path + ": " + name + " is " + shape_str(t.shape()) +
                                 "; adapters saved converted from a start taken out of the base "
                                 "have an even rank (the trained half, then the start)");
      const int64_t r = t.shape()[dim] / 2;
      const Tensor start = narrow(t, dim, r, r).contiguous();
      (a ? starts[layer].first : starts[layer].second) = a ? start : -start;
      t = narrow(t, dim, 0, r).contiguous();
    }
  }
  return starts;
}

}  // namespace

void load_peft_adapter_tensors(Module& model, const std::string& dir) {
  const AdapterFolderConfig folder = read_adapter_folder_config(dir);
  io::SafetensorsFile weights = read_adapter_weights(dir);
  const std::string path = (fs::path(dir) / kAdapterWeightsFile).string();
  if (!folder.quantization.start_taken_out.empty()) split_stored_starts(weights, path);
  copy_adapter_tensors(model, weights, path, folder.lora);
}

QLoRAReport apply_peft_adapters(CausalLM& model, const std::string& adapter_dir,
                                const std::string& base_dir, const AdapterTraining& training) {
  const AdapterFolderConfig folder = read_adapter_folder_config(adapter_dir, model.config().dtype);
  const std::string recorded = folder.lora.base_model_name_or_path;
  if (!base_dir.empty() && !recorded.empty() &&
      last_component(recorded) !=
          last_component(fs::absolute(base_dir).lexically_normal().string()))
    throw AdapterBaseMismatch((fs::path(adapter_dir) / kAdapterConfigFile).string() +
                              ": the adapters were made for base \"" + recorded + "\", not " +
                              base_dir);
  // The weights are read and checked against the config before the model
  // is converted: a bad file leaves the model as it was.
  const std::string weights_path = (fs::path(adapter_dir) / kAdapterWeightsFile).string();
  io::SafetensorsFile weights = read_adapter_weights(adapter_dir);
  // PEFT adapts an image-text model's vision tower too where target_modules
  // selects its layers (all-linear, q_proj); those change image inputs
  // only, which quanta does not read: left out, and counted.
  const bool image_text = !model.config().image_text_config.empty();
  int64_t vision_left_out = 0;
  if (image_text)
    std::erase_if(weights.tensors, [&](const auto& named) {
      const std::string& n = named.first;
      const bool vision =
          n.starts_with(kPeftPrefix) && outside_decoder(n.substr(kPeftPrefix.size()));
      vision_left_out += vision;
      return vision;
    });
  QLoRAOptions options;
  if (!folder.quantization.start_taken_out.empty())
    options.stored_starts = split_stored_starts(weights, weights_path);
  check_stored_rank(weights, folder.lora, weights_path);
  options.lora = folder.lora;
  options.quantization = folder.quantization;
  options.seed = training.seed;
  if (training.lora_dropout) options.lora.lora_dropout = *training.lora_dropout;
  if (training.compute_dtype) options.quantization.compute_dtype = *training.compute_dtype;
  options.on_layer_converted = training.on_layer_converted;
  options.refuse_unused_settings = false;  // PEFT loads such folders
  options.refuse_unmatched_targets = !image_text;
  const std::string config_path = (fs::path(adapter_dir) / kAdapterConfigFile).string();
  // Every tensor the conversion will make is checked against the file
  // first: one that does not fit leaves the model as it was.
  std::vector<std::pair<std::string, Shape>> planned;
  try {
    planned = planned_trained_tensors(model, options);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(config_path + " does not fit the model: " + e.what());
  }
  for (auto& [name, shape] : planned) name = std::string(kPeftPrefix) + name;
  check_adapter_file(weights, weights_path, planned);
  QLoRAReport report;
  try {
    report = apply_qlora(model, options);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(config_path + " does not fit the model: " + e.what());
  }
  copy_adapter_tensors(model, weights, weights_path, folder.lora);
  report.vision_tensors_left_out = vision_left_out;
  return report;
}

}  // namespace quanta::llm
