// Model folders: config.json, one safetensors file or an index and shards.
#include "llm/model/model_folder.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "engine/io/atomic_file.h"
#include "engine/io/safetensors.h"
#include "llm/model/weight_names.h"

namespace quanta::llm {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void folder_fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

// The index's weight map: shard file -> the names it should hold.
std::map<std::string, std::set<std::string>> read_index(const std::string& path) {
  std::ifstream in(path);
  if (!in) folder_fail(path, "cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    folder_fail(path, std::string("not JSON (") + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
    folder_fail(path, "has no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> shards;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    if (!file.is_string()) folder_fail(path, "weight_map[\"" + name + "\"] is not a file name");
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      folder_fail(path,
                  "weight_map[\"" + name + "\"] names \"" + f + "\", not a file in the folder");
    shards[f].insert(name);
  }
  if (shards.empty()) folder_fail(path, "weight_map is empty");
  return shards;
}

// True when `path` (canonical) lies inside folder `root` (canonical).
bool lies_inside(const fs::path& path, const fs::path& root) {
  const fs::path rel = path.lexically_relative(root);
  return !rel.empty() && *rel.begin() != "..";
}

}  // namespace

std::string model_folder_file(const std::string& dir, const std::string& name) {
  const fs::path path = fs::path(dir) / name;
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(path, ec);
  if (ec || !fs::exists(link)) return path.string();
  if (fs::is_symlink(link)) {
    const fs::path target = fs::weakly_canonical(path, ec);
    if (ec || !fs::exists(target)) folder_fail(path.string(), "is a symlink to nothing");
    const fs::path root = fs::canonical(dir, ec);
    // The hub cache links snapshots/<revision>/<file> to ../../blobs/<hash>.
    const bool cached = root.parent_path().filename() == "snapshots" &&
                        lies_inside(target, root.parent_path().parent_path() / "blobs");
    if (ec || !(lies_inside(target, root) || cached))
      folder_fail(path.string(), "is a symlink to " + target.string() + ", outside the folder");
  }
  if (!fs::is_regular_file(path, ec)) folder_fail(path.string(), "is not a regular file");
  return path.string();
}

StateDict read_model_weights(const std::string& dir,
                             const std::function<bool(const std::string&)>& keep) {
  const fs::path root(dir);
  const fs::path single = model_folder_file(dir, "model.safetensors");
  const fs::path index = model_folder_file(dir, "model.safetensors.index.json");
  const auto kept = [&](const std::string& name) { return !keep || keep(name); };
  StateDict out;
  if (fs::exists(single)) {
    for (auto& [name, t] : io::load_safetensors(single.string()).tensors)
      if (kept(name)) out.push_back({name, std::move(t)});
    return out;
  }
  if (!fs::exists(index))
    folder_fail(dir, "holds neither model.safetensors nor model.safetensors.index.json");
  for (const auto& [file, names] : read_index(index.string())) {
    const fs::path shard = model_folder_file(dir, file);
    if (!fs::exists(shard))
      folder_fail(index.string(), "lists shard " + file + ", which is not in the folder");
    if (std::none_of(names.begin(), names.end(), kept)) continue;
    io::SafetensorsFile f = io::load_safetensors(shard.string());
    std::set<std::string> seen;
    for (auto& [name, t] : f.tensors) {
      if (!names.count(name))
        folder_fail(shard.string(),
                    "holds " + name + ", which the index does not list for this shard");
      seen.insert(name);
      if (kept(name)) out.push_back({name, std::move(t)});
    }
    for (const auto& name : names)
      if (!seen.count(name))
        folder_fail(shard.string(), "lacks " + name + ", which the index lists");
  }
  return out;
}

std::shared_ptr<CausalLM> load_causal_lm(const std::string& dir, Device device) {
  DecoderConfig config = read_decoder_config(model_folder_file(dir, "config.json"));
  // An image-text model's vision tower is not read.
  StateDict weights = read_model_weights(
      dir, [&](const std::string& name) { return decoder_weight_name(config, name).has_value(); });
  if (!device.is_cpu())
    for (auto& [name, t] : weights) t = t.to(device);
  try {
    return std::make_shared<CausalLM>(std::move(config), weights);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(dir + ": " + e.what());
  }
}

void save_causal_lm(const CausalLM& model, const std::string& dir, const StateDict& beside) {
  fs::create_directories(dir);
  io::write_text_atomic((fs::path(dir) / "config.json").string(),
                        decoder_config_json(model.config()), "save_causal_lm");
  io::TensorMap tensors;
  for (const auto& [name, t] : model.state_dict())
    tensors.push_back({stored_weight_name(model.config(), name), t.detach()});
  for (const auto& [name, t] : beside) tensors.push_back({name, t});
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
}

void copy_tokenizer_files(const std::string& from, const std::string& to) {
  for (const char* file :
       {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "generation_config.json", "chat_template.jinja"})
    if (fs::exists(fs::path(from) / file))
      fs::copy_file(fs::path(from) / file, fs::path(to) / file,
                    fs::copy_options::overwrite_existing);
  // transformers (4.50 on) keeps named chat templates beside the default.
  const fs::path templates = fs::path(from) / "additional_chat_templates";
  if (fs::is_directory(templates)) {
    fs::create_directories(fs::path(to) / "additional_chat_templates");
    for (const auto& e : fs::directory_iterator(templates))
      if (e.path().extension() == ".jinja")
        fs::copy_file(e.path(), fs::path(to) / "additional_chat_templates" / e.path().filename(),
                      fs::copy_options::overwrite_existing);
  }
  const std::string source = model_folder_file(from, "config.json");
  const std::string target = (fs::path(to) / "config.json").string();
  std::ifstream in(source), out_in(target);
  if (!in || !out_in) return;
  const nlohmann::json base = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  nlohmann::json written = nlohmann::json::parse(out_in, nullptr, /*allow_exceptions=*/false);
  if (!base.is_object() || !written.is_object()) return;
  // Where the ids live: the top level, and an image-text model's text_config.
  const auto copy_ids = [](const nlohmann::json& a, nlohmann::json& b) {
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (a.contains(key)) b[key] = a.at(key);
  };
  copy_ids(base, written);
  if (base.contains("text_config") && base.at("text_config").is_object() &&
      written.contains("text_config") && written.at("text_config").is_object())
    copy_ids(base.at("text_config"), written.at("text_config"));
  io::write_text_atomic(target, written.dump(2) + "\n", "copy_tokenizer_files");
}

std::vector<int64_t> special_token_ids(const std::string& dir, const std::string& key) {
  // transformers' generate reads generation_config.json when the folder has
  // one (its ids, none when absent), config.json only without it.
  for (const char* name : {"generation_config.json", "config.json"}) {
    const std::string path = model_folder_file(dir, name);
    std::ifstream in(path);
    if (!in) continue;
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      throw std::invalid_argument(path + ": not a JSON object");
    std::vector<int64_t> ids;
    const nlohmann::json v = j.value(key, nlohmann::json());
    const auto take = [&](const nlohmann::json& id) {
      if (!id.is_number_integer())
        throw std::invalid_argument(path + ": " + key +
                                    " must be a token id or a list of them, "
                                    "got " +
                                    v.dump());
      // A negative id names no token (nothing to stop at, nothing to mark).
      if (id.get<int64_t>() >= 0) ids.push_back(id.get<int64_t>());
    };
    if (v.is_array())
      for (const nlohmann::json& id : v) take(id);
    else if (!v.is_null())
      take(v);
    return ids;
  }
  return {};
}

}  // namespace quanta::llm
