#include "train/config.h"

#include <bit>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "data/fashion_mnist.h"
#include "train/limits.h"
#include "train/quantizer.h"
#include "train/quantizer_config.h"

namespace quanta::train {
namespace {

using nlohmann::json;

const char* const kKeys[] = {"data",         "limit_train",  "limit_test", "steps",
                             "epochs",       "batch_size",   "lr",         "lr_schedule",
                             "warmup_steps", "weight_decay", "recon_loss", "seed",
                             "log_every",    "eval_every",   "threads",    "device",
                             "nproc",        "precision",    "model",      "quantizer"};
// Keys an older checkpoint's config may lack; they keep their defaults.
const char* const kOptionalKeys[] = {"lr_schedule", "warmup_steps", "weight_decay", "recon_loss",
                                     "precision"};
const char* const kModelKeys[] = {"hidden", "dim", "latent_norm_groups", "arch"};
// Model keys an older checkpoint's config may lack; they keep their defaults.
const char* const kOptionalModelKeys[] = {"latent_norm_groups", "arch"};
// What a resumed run must share with its checkpoint to continue it exactly.
const char* const kRunDefining[] = {"batch_size",   "lr",         "lr_schedule", "warmup_steps",
                                    "weight_decay", "recon_loss", "seed",        "limit_train",
                                    "precision",    "model",      "quantizer"};

std::string dump(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// "model.adapters: checkpoint "/a", now "/b"": the first setting that
// differs, however deep, rather than two truncated objects; an object's
// "type" first (another quantizer's settings all differ).
std::string first_difference(const std::string& key, const json& a, const json& b) {
  if (a.is_object() && b.is_object()) {
    if (a.value("type", json()) != b.value("type", json()))
      return first_difference(key + ".type", a.value("type", json()), b.value("type", json()));
    for (const json* side : {&a, &b})
      for (const auto& item : side->items()) {
        const std::string& k = item.key();
        const json x = a.value(k, json()), y = b.value(k, json());
        if (x != y) return first_difference(key + "." + k, x, y);
      }
  }
  const auto shown = [](const json& v) { return v.is_null() ? std::string("not set") : dump(v); };
  return key + ": checkpoint " + shown(a) + ", now " + shown(b);
}

[[noreturn]] void bad(const std::string& key, const std::string& want, const json& v) {
  throw std::invalid_argument("[config] '" + key + "' must be " + want + ", got " + dump(v));
}

// An integer in [min, max] (limits.h: beyond max, the run's arithmetic
// could overflow). JSON's non-negative integers are held unsigned.
int64_t get_int(const json& j, const std::string& key, int64_t min, int64_t max) {
  const json& v = j.at(key);
  const bool below = !v.is_number_integer() ||
                     (v.is_number_unsigned() ? min > 0 && v.get<uint64_t>() < uint64_t(min)
                                             : v.get<int64_t>() < min);
  if (below)
    bad(key, min == 0 ? "an integer >= 0" : min > 0 ? "a positive integer" : "an integer >= -1", v);
  if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(max) : v.get<int64_t>() > max)
    bad(key, "at most " + std::to_string(max), v);
  return v.get<int64_t>();
}

template <class Keys>
void check_keys(const json& j, const Keys& keys, const std::string& where) {
  if (!j.is_object()) bad(where.empty() ? "config" : where, "an object", j);
  for (const auto& [k, _] : j.items()) {
    bool known = false;
    std::string list;
    for (const char* key : keys) {
      known = known || k == key;
      list += (list.empty() ? "" : ", ") + std::string(key);
    }
    if (!known)
      throw std::invalid_argument("[config] unknown key '" + (where.empty() ? "" : where + ".") +
                                  k + "' (keys: " + list + ")");
  }
}

// One of `choices` at j[key]; `name` is how errors show the key.
std::string get_choice(const json& j, const std::string& key, const std::string& name,
                       std::initializer_list<const char*> choices) {
  const json& v = j.at(key);
  std::vector<std::string> quoted;
  for (const char* c : choices) {
    if (v.is_string() && v == c) return c;
    std::string q(1, '"');
    q.append(c).push_back('"');
    quoted.push_back(std::move(q));
  }
  std::string want;
  for (std::size_t i = 0; i < quoted.size(); ++i)
    want += (i == 0 ? "" : i + 1 == quoted.size() ? " or " : ", ") + quoted[i];
  bad(name, want, v);
}

template <size_t N>
bool listed(const char* const (&list)[N], const std::string& k) {
  for (const char* o : list)
    if (k == o) return true;
  return false;
}

// `config` with the keys an older config lacks set to today's defaults, so
// that resuming its checkpoint compares like with like.
json with_optional_defaults(json config) {
  if (!config.is_object()) return config;
  const json defaults = default_config_json();
  for (const char* k : kOptionalKeys)
    if (!config.contains(k)) config[k] = defaults[k];
  if (config.contains("model") && config["model"].is_object())
    for (const char* k : kOptionalModelKeys)
      if (!config["model"].contains(k)) config["model"][k] = defaults["model"][k];
  return config;
}

}  // namespace

json default_config_json() {
  TrainConfig c;
  c.data = data::kFashionMnistDir;
  c.epochs = 2;
  // VQ with a codebook seeded by k-means on the first batch and dead codes
  // re-seeded from the batch: near-full codebook use (docs/train.md).
  c.quantizer = {{"type", "vq"},
                 {"codebook_size", 512},
                 {"kmeans_init", true},
                 {"threshold_ema_dead_code", 2}};
  return config_to_json(c);
}

json recipe_layer(const json& asked) {
  const json defaults = default_config_json();
  const json q = asked.contains("quantizer") && asked["quantizer"].is_object() ? asked["quantizer"]
                                                                               : json::object();
  // A type that is not a string is left for config_from_json to name.
  const std::string type = q.contains("type") && q["type"].is_string()
                               ? q["type"].get<std::string>()
                               : defaults["quantizer"]["type"].get<std::string>();
  // Each family's figures on this model are in docs/train.md ("Recipes").
  // The GroupNorm in front of the latent's projection fixes the scale the
  // projection sees: without it FSQ's usage swings with the seed, and LFQ
  // without it or spherical codes collapses to a few codes within two epochs.
  json layer = {{"quantizer", {{"type", type}}}};
  const json books = q.value("num_codebooks", json(1));
  // The norm's groups must divide the hidden width the run asks for.
  const json hidden_asked = asked.contains("model") && asked["model"].is_object()
                                ? asked["model"].value("hidden", json())
                                : json();
  const int64_t hidden = hidden_asked.is_number_integer() && hidden_asked.get<int64_t>() > 0
                             ? hidden_asked.get<int64_t>()
                             : defaults["model"]["hidden"].get<int64_t>();
  auto norm_groups = [hidden](int64_t wanted) { return std::gcd(hidden, wanted); };
  if (type == "rvq" || type == "grvq") {
    // The defaults' VQ recipe on every level: without dead-code expiry the
    // first level settles on a few codes (1.4% of 512).
    layer["quantizer"]["kmeans_init"] = true;
    layer["quantizer"]["threshold_ema_dead_code"] = 2;
  } else if (type == "hvq") {
    // The reference's levels (k-means init, dead-code expiry) with a codebook
    // per level: one codebook shared by the levels leaves most of its codes
    // unused at the coarse levels (docs/train.md, "Recipes").
    layer["quantizer"]["shared_codebook"] = false;
  } else if (type == "fsq" || type == "fsp" || type == "rfsq") {
    // A 512-point grid the encoder writes directly (no projections), with
    // FSQ's symmetric levels so that every level is reachable from either
    // side of the bound; two channels per norm group at the default width.
    layer["lr"] = 0.005;
    layer["model"] = {{"dim", 3}, {"latent_norm_groups", norm_groups(16)}};
    layer["quantizer"]["levels"] = {8, 8, 8};
    if (type != "fsp") layer["quantizer"]["preserve_symmetry"] = true;
    // Later levels correct the first so well that it settles on half its
    // codes, unless training sometimes drops them.
    if (type == "rfsq") layer["quantizer"]["quantize_dropout"] = true;
    const json levels = q.value("levels", json());
    if (levels.is_array() && books.is_number_integer())
      layer["model"]["dim"] = int64_t(levels.size()) * books.get<int64_t>();
  } else if (type == "lfq" || type == "rlfq") {
    // vector-quantize-pytorch's example recipe: codes on the sphere and a
    // light entropy loss.
    layer["model"] = {{"latent_norm_groups", norm_groups(4)}};
    layer["quantizer"]["spherical"] = true;
    layer["quantizer"]["entropy_loss_weight"] = 0.02;
    if (type == "lfq") {
      // A bit per latent channel: 2^10 codes, or the codebook size asked for.
      layer["model"]["dim"] = 10;
      const json size = q.value("codebook_size", json());
      if (size.is_number_integer() && books.is_number_integer() && size.get<int64_t>() > 1 &&
          std::has_single_bit(size.get<uint64_t>()))
        layer["model"]["dim"] = std::bit_width(size.get<uint64_t>() - 1) * books.get<int64_t>();
    }
  }
  return layer;
}

json compose_config(const std::vector<json>& layers) {
  json asked = json::object();
  for (const json& l : layers) asked = merge_config(asked, l);
  json config = merge_config(default_config_json(), recipe_layer(asked));
  for (const json& l : layers) config = merge_config(config, l);
  return config;
}

json merge_config(json base, const json& layer) {
  check_keys(layer, kKeys, "");
  const bool has_steps = layer.contains("steps") && layer["steps"] != 0;
  const bool has_epochs = layer.contains("epochs") && layer["epochs"] != 0;
  if (has_steps && has_epochs)
    throw std::invalid_argument("[config] give steps or epochs, not both");
  for (const auto& [k, v] : layer.items()) {
    if ((k == "model" || k == "quantizer") && v.is_object() && base[k].is_object()) {
      // A new quantizer type starts from no options: the old type's options
      // would not apply to it.
      if (k == "quantizer" && v.contains("type") && base[k].value("type", json()) != v["type"])
        base[k] = json::object();
      for (const auto& [kk, vv] : v.items()) base[k][kk] = vv;
    } else {
      base[k] = v;
    }
  }
  if (has_steps) base["epochs"] = 0;
  if (has_epochs) base["steps"] = 0;
  return base;
}

TrainConfig config_from_json(const json& j) {
  check_keys(j, kKeys, "");
  for (const char* k : kKeys)
    if (!j.contains(k) && !listed(kOptionalKeys, k))
      throw std::invalid_argument(std::string("[config] missing key '") + k + "'");
  TrainConfig c;
  if (!j["data"].is_string()) bad("data", "a folder name", j["data"]);
  c.data = j["data"].get<std::string>();
  c.limit_train = get_int(j, "limit_train", -1, kMaxCount);
  c.limit_test = get_int(j, "limit_test", -1, kMaxCount);
  c.steps = get_int(j, "steps", 0, kMaxSteps);
  c.epochs = get_int(j, "epochs", 0, kMaxEpochs);
  if ((c.steps > 0) == (c.epochs > 0))
    throw std::invalid_argument("[config] set exactly one of steps and epochs (> 0), got steps " +
                                std::to_string(c.steps) + " and epochs " +
                                std::to_string(c.epochs));
  c.batch_size = get_int(j, "batch_size", 1, kMaxBatchSize);
  if (!j["lr"].is_number() || !(j["lr"].get<double>() > 0) || !std::isfinite(j["lr"].get<double>()))
    bad("lr", "a positive number", j["lr"]);
  c.lr = j["lr"].get<double>();
  if (j.contains("lr_schedule"))
    c.lr_schedule = get_choice(j, "lr_schedule", "lr_schedule", {"constant", "linear", "cosine"});
  if (j.contains("recon_loss"))
    c.recon_loss = get_choice(j, "recon_loss", "recon_loss", {"mse", "l1"});
  if (j.contains("warmup_steps")) c.warmup_steps = get_int(j, "warmup_steps", 0, kMaxSteps);
  if (j.contains("weight_decay")) {
    const json& v = j["weight_decay"];
    if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
      bad("weight_decay", "a number >= 0", v);
    c.weight_decay = v.get<double>();
  }
  if (!j["seed"].is_number_unsigned()) bad("seed", "an integer >= 0", j["seed"]);
  c.seed = j["seed"].get<uint64_t>();
  c.log_every = get_int(j, "log_every", 1, kMaxCount);
  c.eval_every = get_int(j, "eval_every", 0, kMaxCount);
  c.threads = get_int(j, "threads", 0, kMaxThreads);
  if (!j["device"].is_string()) bad("device", "\"cpu\" or \"cuda\"", j["device"]);
  c.device = j["device"].get<std::string>();
  c.nproc = get_int(j, "nproc", 1, kMaxRanks);
  if (j.contains("precision"))
    c.precision = get_choice(j, "precision", "precision", {"f32", "bf16"});
  check_keys(j["model"], kModelKeys, "model");
  for (const char* k : kModelKeys)
    if (!j["model"].contains(k) && !listed(kOptionalModelKeys, k))
      throw std::invalid_argument(std::string("[config] missing key 'model.") + k + "'");
  c.model.hidden = get_int(j["model"], "hidden", 1, kMaxChannels);
  c.model.dim = get_int(j["model"], "dim", 1, kMaxChannels);
  if (j["model"].contains("latent_norm_groups"))
    c.model.latent_norm_groups = get_int(j["model"], "latent_norm_groups", 0, kMaxChannels);
  if (j["model"].contains("arch"))
    c.model.arch = get_choice(j["model"], "arch", "model.arch", {"conv", "vqp-example"});
  if (c.model.latent_norm_groups > 0 && c.model.hidden % c.model.latent_norm_groups != 0)
    throw std::invalid_argument("[config] 'model.latent_norm_groups' must divide model.hidden (" +
                                std::to_string(c.model.hidden) + "), got " +
                                std::to_string(c.model.latent_norm_groups));
  validate_quantizer_config(j["quantizer"]);
  c.quantizer = j["quantizer"];
  return c;
}

json config_to_json(const TrainConfig& c) {
  return {{"data", c.data},
          {"limit_train", c.limit_train},
          {"limit_test", c.limit_test},
          {"steps", c.steps},
          {"epochs", c.epochs},
          {"batch_size", c.batch_size},
          {"lr", c.lr},
          {"lr_schedule", c.lr_schedule},
          {"warmup_steps", c.warmup_steps},
          {"weight_decay", c.weight_decay},
          {"recon_loss", c.recon_loss},
          {"seed", c.seed},
          {"log_every", c.log_every},
          {"eval_every", c.eval_every},
          {"threads", c.threads},
          {"device", c.device},
          {"nproc", c.nproc},
          {"precision", c.precision},
          {"model",
           {{"hidden", c.model.hidden},
            {"dim", c.model.dim},
            {"latent_norm_groups", c.model.latent_norm_groups},
            {"arch", c.model.arch}}},
          {"quantizer", c.quantizer}};
}

json read_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open config file");
  std::stringstream ss;
  ss << in.rdbuf();
  json j;
  try {
    j = json::parse(ss.str());
  } catch (const json::parse_error& e) {
    throw std::runtime_error(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw std::runtime_error(path + ": a config file holds one JSON object");
  return j;
}

std::string resume_conflict(const json& checkpoint, const json& now) {
  const json then = with_optional_defaults(checkpoint), full = with_optional_defaults(now);
  for (const char* k : kRunDefining) {
    const json a = then.value(k, json()), b = full.value(k, json());
    if (a != b) return first_difference(k, a, b);
  }
  return "";
}

nlohmann::json resolved_config(const nlohmann::json& config) {
  const TrainConfig c = config_from_json(config);
  nlohmann::json out = config_to_json(c);
  out["quantizer"] = resolved_quantizer_config(c.quantizer, c.model.dim);
  return out;
}

}  // namespace quanta::train
