// Model folders: config.json, one safetensors file or an index and shards.
#include "llm/model/model_folder.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "engine/factory.h"
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

namespace {

// A weight file of a folder and, for a shard, the names its index lists.
struct WeightFile {
  fs::path path;
  std::optional<std::set<std::string>> listed;  // empty: the single model.safetensors
};

// The folder's model.safetensors, or the shards its index lists (each present).
std::vector<WeightFile> weight_files_of(const std::string& dir) {
  const fs::path single = model_folder_file(dir, "model.safetensors");
  const fs::path index = model_folder_file(dir, "model.safetensors.index.json");
  if (fs::exists(single)) return {{single, std::nullopt}};
  if (!fs::exists(index))
    folder_fail(dir, "holds neither model.safetensors nor model.safetensors.index.json");
  std::vector<WeightFile> files;
  for (auto& [file_name, names] : read_index(index.string())) {
    const fs::path shard = model_folder_file(dir, file_name);
    if (!fs::exists(shard))
      folder_fail(index.string(), "lists shard " + file_name + ", which is not in the folder");
    files.push_back({shard, std::move(names)});
  }
  return files;
}

}  // namespace

std::vector<std::string> model_weight_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const WeightFile& f : weight_files_of(dir)) out.push_back(f.path.string());
  return out;
}

ModelWeightFiles::ModelWeightFiles(const std::string& dir,
                                   const std::function<bool(const std::string&)>& keep) {
  const auto kept = [&](const std::string& name) { return !keep || keep(name); };
  const auto add = [&](std::shared_ptr<io::SafetensorsReader> file, const std::string& name) {
    if (files_.empty() || files_.back() != file) files_.push_back(std::move(file));
    where_.emplace(name, files_.size() - 1);
    names_.push_back(name);
  };
  for (const WeightFile& w : weight_files_of(dir)) {
    if (!w.listed) {
      auto file = std::make_shared<io::SafetensorsReader>(w.path.string());
      for (const std::string& name : file->names())
        if (kept(name)) add(file, name);
      return;
    }
    const std::set<std::string>& names = *w.listed;
    if (std::none_of(names.begin(), names.end(), kept)) continue;
    auto file = std::make_shared<io::SafetensorsReader>(w.path.string());
    const std::vector<std::string> held = file->names();
    for (const std::string& name : held)
      if (!names.count(name))
        folder_fail(w.path.string(),
                    "holds " + name + ", which the index does not list for this shard");
    for (const auto& name : names)
      if (!file->contains(name))
        folder_fail(w.path.string(), "lacks " + name + ", which the index lists");
    for (const std::string& name : held)
      if (kept(name)) add(file, name);
  }
}

const io::SafetensorsReader& ModelWeightFiles::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end())
    throw std::invalid_argument("[ModelWeightFiles] the folder's weights hold no " + name);
  return *files_[it->second];
}

bool ModelWeightFiles::contains(const std::string& name) const { return where_.count(name) > 0; }
DType ModelWeightFiles::dtype(const std::string& name) const { return file_of(name).dtype(name); }
const Shape& ModelWeightFiles::shape(const std::string& name) const {
  return file_of(name).shape(name);
}
Tensor ModelWeightFiles::read(const std::string& name) const { return file_of(name).read(name); }

StateDict read_model_weights(const std::string& dir,
                             const std::function<bool(const std::string&)>& keep) {
  const ModelWeightFiles files(dir, keep);
  StateDict out;
  out.reserve(files.names().size());
  for (const std::string& name : files.names()) out.push_back({name, files.read(name)});
  return out;
}

namespace {

// A weight that holds no bytes yet: CausalLM::defer_weights fills it.
Tensor unread_weight(const Shape& shape, DType dtype, Device device) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(0, device);
  impl->dtype = dtype;
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  return Tensor(std::move(impl));
}

}  // namespace

std::function<Tensor(const std::string&)> decoder_weight_reader(const std::string& dir) {
  const DecoderConfig config = read_decoder_config(model_folder_file(dir, "config.json"));
  auto files = std::make_shared<const ModelWeightFiles>(
      dir, [&](const std::string& name) { return decoder_weight_name(config, name).has_value(); });
  std::map<std::string, std::string> stored_of;  // the model's name -> the file's
  for (const std::string& stored : files->names())
    stored_of.emplace(*decoder_weight_name(config, stored), stored);
  return [dir, files, stored_of = std::move(stored_of)](const std::string& name) {
    const auto it = stored_of.find(name);
    if (it == stored_of.end()) throw std::invalid_argument(dir + " holds no weight " + name);
    return files->read(it->second);
  };
}

std::shared_ptr<CausalLM> load_causal_lm(const std::string& dir, Device device,
                                         const LoadOptions& options) {
  DecoderConfig config = read_decoder_config(model_folder_file(dir, "config.json"));
  // An image-text model's vision tower is not read.
  auto files = std::make_shared<const ModelWeightFiles>(
      dir, [&](const std::string& name) { return decoder_weight_name(config, name).has_value(); });
  // What may stay in the files: the decoder layers' linear weights, where
  // the file holds them as the model expects them (anything else is read,
  // so that CausalLM reports it as it always has).
  std::map<std::string, Shape> deferrable;
  if (options.defer_layer_weights) {
    // A config of more layers than the files hold is refused before its
    // names are listed (a billion layers would not fit in memory).
    std::vector<std::string> names;
    for (const std::string& stored : files->names())
      names.push_back(*decoder_weight_name(config, stored));
    try {
      CausalLM::check_layer_count(config, names);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(dir + ": " + e.what());
    }
    const std::string layers = config.decoder_module() + ".layers.";
    for (const auto& [name, shape] : CausalLM::expected_weights(config))
      if (name.starts_with(layers) && name.ends_with(".weight") && shape.size() == 2)
        deferrable.emplace(name, shape);
  }
  StateDict weights;
  std::map<std::string, std::string> stored_of;  // the model's name -> the file's
  for (const std::string& stored : files->names()) {
    const std::string name = *decoder_weight_name(config, stored);
    const auto it = deferrable.find(name);
    if (it != deferrable.end() && files->shape(stored) == it->second &&
        is_floating(files->dtype(stored))) {
      weights.push_back({stored, unread_weight(it->second, config.dtype, device)});
      stored_of.emplace(name, stored);
      continue;
    }
    // One tensor on the host at a time.
    Tensor t = files->read(stored);
    weights.push_back({stored, device.is_cpu() ? t : t.to(device)});
  }
  std::shared_ptr<CausalLM> model;
  try {
    model = std::make_shared<CausalLM>(std::move(config), weights);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(dir + ": " + e.what());
  }
  // In the model's order (the files' may differ).
  std::vector<std::string> deferred;
  for (const auto& [name, shape] : CausalLM::expected_weights(model->config()))
    if (stored_of.count(name)) deferred.push_back(name);
  if (!deferred.empty())
    model->defer_weights(deferred, [files, stored_of = std::move(stored_of)](const std::string& n) {
      return files->read(stored_of.at(n));
    });
  return model;
}

uint64_t parse_shard_size(const std::string& text) {
  const auto fail = [&text]() -> uint64_t {
    throw std::invalid_argument("shard size \"" + text +
                                "\" is not a size: give bytes, or a number with KB, MB, GB or "
                                "TB (\"5GB\", \"500MB\")");
  };
  const auto trim = [](std::string t) {
    while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
    while (!t.empty() && std::isspace(static_cast<unsigned char>(t.front()))) t.erase(0, 1);
    return t;
  };
  const std::string t = trim(text);
  if (t.empty()) return fail();
  // A whole number of bytes, read exactly.
  if (t.find_first_not_of("0123456789") == std::string::npos) {
    uint64_t bytes = 0;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), bytes);
    if (ec != std::errc() || end != t.data() + t.size() || bytes == 0) return fail();
    return bytes;
  }
  // A decimal number and a unit, as huggingface_hub reads them (int(value *
  // unit)); from_chars: no locale, no hex.
  if (t.size() < 3) return fail();
  std::string unit = t.substr(t.size() - 2);
  for (char& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  const std::map<std::string, double> units = {{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  const auto it = units.find(unit);
  if (it == units.end()) return fail();
  const std::string number = trim(t.substr(0, t.size() - 2));
  if (number.empty() || number.find_first_not_of("0123456789.") != std::string::npos) return fail();
  double value = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value,
                                         std::chars_format::fixed);
  if (ec != std::errc() || end != number.data() + number.size()) return fail();
  const double bytes = value * it->second;
  if (!(bytes >= 1) || bytes > 1e18) return fail();
  return static_cast<uint64_t>(bytes);
}

void write_model_weights(const std::string& dir, const std::vector<io::TensorSource>& weights,
                         const SaveOptions& options, const char* op) {
  if (options.max_shard_bytes == 0)
    throw std::invalid_argument(std::string("[") + op + "] max_shard_bytes must be positive");
  // Everything the names, dtypes and shapes refuse, across all the files.
  io::check_safetensors_sources(weights);
  // save_pretrained's split: in order, the open file closed when the next
  // tensor would take it past the limit; a tensor over it in a file of its
  // own, listed when met (the open file goes on after it).
  std::vector<std::vector<io::TensorSource>> shards;
  std::vector<io::TensorSource> open;
  uint64_t in_open = 0, total_bytes = 0, total_elements = 0;
  for (const io::TensorSource& w : weights) {
    const uint64_t bytes = uint64_t(quanta::detail::storage_bytes(w.shape, w.dtype).value_or(0));
    total_bytes += bytes;
    total_elements += uint64_t(checked_numel(w.shape).value_or(0));
    if (bytes > options.max_shard_bytes) {
      shards.push_back({w});
      continue;
    }
    if (!open.empty() && in_open + bytes > options.max_shard_bytes) {
      shards.push_back(std::move(open));
      open.clear();
      in_open = 0;
    }
    open.push_back(w);
    in_open += bytes;
  }
  if (!open.empty() || shards.empty()) shards.push_back(std::move(open));
  const fs::path folder(dir);
  const fs::path single = folder / "model.safetensors";
  const fs::path index = folder / "model.safetensors.index.json";
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  // Every file is made beside its target first: until all are, the folder
  // is as it was (an error while making a tensor changes nothing).
  std::vector<std::unique_ptr<io::AtomicFileWriter>> staged;
  std::set<std::string> names;
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  if (shards.size() == 1) {
    staged.push_back(io::stage_safetensors(single.string(), shards[0], meta));
    names.insert(single.filename().string());
  } else {
    char name[64];
    for (std::size_t i = 0; i < shards.size(); ++i) {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      staged.push_back(io::stage_safetensors((folder / name).string(), shards[i], meta));
      for (const io::TensorSource& w : shards[i]) map[w.name] = name;
      names.insert(name);
    }
  }
  // Then in place, in an order that never shows a reader old weights as new
  // ones: loaders take model.safetensors before an index, so shards replace
  // a single file only once it is gone, and an old index goes before the
  // shards it may list are replaced (between the two the folder has no
  // weights to load, rather than a mix).
  const auto remove_stale = [&](const std::function<bool(const std::string&)>& stale) {
    for (const auto& e : fs::directory_iterator(folder)) {
      const std::string f = e.path().filename().string();
      if (!names.count(f) && e.is_regular_file() && stale(f)) fs::remove(e.path());
    }
  };
  const std::regex shard_name(R"(model-\d{5}-of-\d{5}\.safetensors)");
  const auto is_shard = [&](const std::string& f) { return std::regex_match(f, shard_name); };
  if (shards.size() == 1) {
    staged[0]->commit();
    remove_stale([&](const std::string& f) { return f == index.filename() || is_shard(f); });
    return;
  }
  remove_stale([&](const std::string& f) { return f == single.filename(); });
  if (fs::exists(index)) fs::remove(index);
  for (const auto& file : staged) file->commit();
  nlohmann::json j;  // sorted keys, as transformers dumps the index
  j["metadata"] = {{"total_size", total_bytes}, {"total_parameters", total_elements}};
  j["weight_map"] = map;
  io::write_text_atomic(index.string(), j.dump(2) + "\n", op);
  names.insert(index.filename().string());
  remove_stale(is_shard);
}

void save_causal_lm(const CausalLM& model, const std::string& dir, const StateDict& beside,
                    const SaveOptions& options) {
  save_causal_lm_streamed(model.config(), dir, io::tensor_sources(model.state_dict()), beside,
                          options);
}

void save_causal_lm_streamed(const DecoderConfig& config, const std::string& dir,
                             const std::vector<io::TensorSource>& weights, const StateDict& beside,
                             const SaveOptions& options) {
  fs::create_directories(dir);
  std::vector<io::TensorSource> stored = weights;
  for (io::TensorSource& w : stored) w.name = stored_weight_name(config, w.name);
  for (const io::TensorSource& b : io::tensor_sources(beside)) stored.push_back(b);
  write_model_weights(dir, stored, options);
  // After the weights: a merge that fails while making them leaves the
  // folder's config and weights as they were.
  io::write_text_atomic((fs::path(dir) / "config.json").string(), decoder_config_json(config),
                        "save_causal_lm");
}

void copy_tokenizer_files(const std::string& from, const std::string& to) {
  // A file `from` lacks goes from `to` too: an output folder reused from
  // another model would otherwise pair this model's weights with that
  // model's tokenizer.model or chat template, which a loader may prefer.
  const auto mirror = [](const fs::path& source, const fs::path& target) {
    if (fs::exists(source))
      fs::copy_file(source, target, fs::copy_options::overwrite_existing);
    else
      fs::remove(target);
  };
  for (const char* file :
       {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "generation_config.json", "chat_template.jinja"})
    mirror(fs::path(from) / file, fs::path(to) / file);
  // transformers (4.50 on) keeps named chat templates beside the default.
  const fs::path templates = fs::path(from) / "additional_chat_templates";
  const fs::path named = fs::path(to) / "additional_chat_templates";
  if (fs::is_directory(named)) {
    std::vector<fs::path> stale;
    for (const auto& e : fs::directory_iterator(named))
      if (e.path().extension() == ".jinja" && !fs::exists(templates / e.path().filename()))
        stale.push_back(e.path());
    for (const fs::path& p : stale) fs::remove(p);
    if (fs::is_empty(named)) fs::remove(named);
  }
  if (fs::is_directory(templates)) {
    fs::create_directories(named);
    for (const auto& e : fs::directory_iterator(templates))
      if (e.path().extension() == ".jinja")
        fs::copy_file(e.path(), named / e.path().filename(), fs::copy_options::overwrite_existing);
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
