// config.json: transformers' names (both generations) to DecoderConfig and back.
#include "llm/model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace quanta::llm {
namespace {

using nlohmann::json;

// Bounds far above any published model's (vocabularies of 256k, widths of
// 16k, 126 layers) that keep every size and product of two sizes in int64:
// a config of absurd sizes is refused before anything is compared or built.
constexpr int64_t kMaxSize = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxWeightElements = int64_t(1) << 40;
constexpr int64_t kMaxHeadDim = 65536;  // published models use 64 to 256

struct Reader {
  const json& j;
  const std::string& source;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(source + ": " + what);
  }
  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  int64_t integer(const char* key, int64_t fallback = -1) const {
    if (!has(key)) {
      if (fallback >= 0) return fallback;
      fail(std::string("missing \"") + key + "\"");
    }
    const json& v = j.at(key);
    if (!v.is_number_integer())
      fail(std::string("\"") + key + "\" must be an integer, got " + v.dump());
    const int64_t n = v.get<int64_t>();
    if (n <= 0) fail(std::string("\"") + key + "\" must be > 0, got " + std::to_string(n));
    if (n > kMaxSize)
      fail(std::string("\"") + key + "\" is " + std::to_string(n) +
           ", more than any model has (at most " + std::to_string(kMaxSize) + ")");
    return n;
  }
  double number(const json& obj, const char* key, double fallback, bool required) const {
    if (!obj.contains(key) || obj.at(key).is_null()) {
      if (required) fail(std::string("missing \"") + key + "\"");
      return fallback;
    }
    const json& v = obj.at(key);
    if (!v.is_number()) fail(std::string("\"") + key + "\" must be a number, got " + v.dump());
    return v.get<double>();
  }
  bool flag(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j.at(key).is_boolean()) fail(std::string("\"") + key + "\" must be true or false");
    return j.at(key).get<bool>();
  }
  std::string text(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j.at(key).is_string()) fail(std::string("\"") + key + "\" must be a string");
    return j.at(key).get<std::string>();
  }
};

DType dtype_of(const Reader& r) {
  // 5.x writes "dtype", 4.x "torch_dtype"; either may be absent (f32).
  const std::string name = r.has("dtype") ? r.text("dtype", "") : r.text("torch_dtype", "float32");
  try {
    return dtype_from_torch_name(name);
  } catch (const std::invalid_argument& e) {
    r.fail(e.what());
  }
}

// Qwen2 and Qwen3 read sliding windows the same way.
bool qwen_windows(const DecoderConfig& c) {
  return c.model_type == "qwen2" || c.model_type == "qwen3";
}

bool gemma_family(const DecoderConfig& c) {
  return c.model_type == "gemma" || c.model_type == "gemma2" || c.model_type == "gemma3_text";
}

// Gemma 2's layout, which Gemma 3 keeps: four norms a layer,
// query_pre_attn_scalar, hidden_activation, per-layer attention types.
bool gemma2_layout(const DecoderConfig& c) {
  return c.model_type == "gemma2" || c.model_type == "gemma3_text";
}

// OLMo 2's layout, which OLMo 3 keeps: norms after each block, q and k
// normalized over all heads.
bool olmo2_layout(const DecoderConfig& c) {
  return c.model_type == "olmo2" || c.model_type == "olmo3";
}

// The models whose layers each have a type (layer_types: full_attention or
// sliding_attention), with a default pattern where the key is absent.
bool typed_layers(const DecoderConfig& c) {
  return gemma2_layout(c) || c.model_type == "olmo3" || c.model_type == "smollm3" ||
         c.model_type == "ministral" || c.model_type == "exaone4";
}

// Gemma 3 and OLMo 3 give each layer type its RoPE.
bool rope_per_layer_type(const DecoderConfig& c) {
  return c.model_type == "gemma3_text" || c.model_type == "olmo3";
}

// One RoPE object (a rope_scaling or rope_parameters object, or null for
// none) into `rope`, whose theta is the default the object's rope_theta
// replaces.
void read_rope_object(const Reader& r, const json* params, RopeConfig& rope,
                      const DecoderConfig& c) {
  if (params) {
    const json& s = *params;
    rope.theta = r.number(s, "rope_theta", rope.theta, false);
    // 4.x wrote the kind as "type" before "rope_type".
    std::string type = "default";
    for (const char* key : {"rope_type", "type"})
      if (s.contains(key) && !s.at(key).is_null() && !s.at(key).is_string())
        r.fail(std::string("rope_scaling \"") + key + "\" must be a string, got " +
               s.at(key).dump());
    if (s.contains("rope_type") && s.at("rope_type").is_string())
      type = s.at("rope_type").get<std::string>();
    else if (s.contains("type") && s.at("type").is_string())
      type = s.at("type").get<std::string>();
    // Phi3Config renames the names its early checkpoints used.
    if (c.model_type == "phi3" && (type == "su" || type == "yarn")) type = "longrope";
    if (type != "default" && type != "linear" && type != "dynamic" && type != "llama3" &&
        type != "longrope" && type != "yarn")
      r.fail("rope_scaling type \"" + type +
             "\" is not supported (supported: default, linear, dynamic, llama3, longrope, yarn)");
    rope.scaling.type = type;
    const bool scaled = type != "default";
    // longrope's and yarn's factor, when absent, is max_position_embeddings
    // over the original (0 here: rope_frequencies derives it).
    const bool derived_factor = type == "longrope" || type == "yarn";
    rope.scaling.factor =
        r.number(s, "factor", derived_factor ? 0.0 : 1.0, scaled && !derived_factor);
    // The length the scaling extends, as transformers resolves it: a
    // top-level original_max_position_embeddings wins over the object's
    // (Phi3Config's class default 4096 where it is absent), then
    // max_position_embeddings.
    const auto original_length = [&]() -> int64_t {
      const double inside =
          r.number(s, "original_max_position_embeddings", double(c.max_position_embeddings), false);
      const double original = r.number(r.j, "original_max_position_embeddings",
                                       c.model_type == "phi3" ? 4096.0 : inside, false);
      if (!(original >= 1 && original <= double(kMaxSize) && original == std::floor(original)))
        r.fail("\"original_max_position_embeddings\" must be a whole number in 1.." +
               std::to_string(kMaxSize));
      return static_cast<int64_t>(original);
    };
    if (type == "longrope" || type == "yarn") {
      rope.scaling.attention_factor = r.number(s, "attention_factor", 0.0, false);
      if (s.contains("attention_factor") && !s.at("attention_factor").is_null() &&
          !(rope.scaling.attention_factor > 0))
        r.fail("rope_scaling \"attention_factor\" must be > 0, got " +
               s.at("attention_factor").dump());
    }
    if (type == "yarn") {
      // transformers takes a zero beta as unset (`or 32`): so does quanta.
      rope.scaling.beta_fast = r.number(s, "beta_fast", 0.0, false);
      rope.scaling.beta_slow = r.number(s, "beta_slow", 0.0, false);
      rope.scaling.mscale = r.number(s, "mscale", 0.0, false);
      rope.scaling.mscale_all_dim = r.number(s, "mscale_all_dim", 0.0, false);
      if (s.contains("truncate") && !s.at("truncate").is_null()) {
        if (!s.at("truncate").is_boolean())
          r.fail("rope_scaling \"truncate\" must be true or false");
        rope.scaling.truncate = s.at("truncate").get<bool>();
      }
      rope.scaling.original_max_position_embeddings = original_length();
    }
    if (type == "longrope") {
      const auto factors = [&](const char* key) {
        std::vector<double> out;
        if (!s.contains(key) || !s.at(key).is_array())
          r.fail(std::string("longrope needs \"") + key + "\", a list of numbers");
        for (const json& v : s.at(key)) {
          if (!v.is_number() || !(v.get<double>() > 0))
            r.fail(std::string("longrope \"") + key + "\" holds " + v.dump() +
                   " (numbers > 0 only)");
          out.push_back(v.get<double>());
        }
        return out;
      };
      rope.scaling.short_factor = factors("short_factor");
      rope.scaling.long_factor = factors("long_factor");
      rope.scaling.original_max_position_embeddings = original_length();
    }
    if (type == "llama3") {
      rope.scaling.low_freq_factor = r.number(s, "low_freq_factor", 1.0, true);
      rope.scaling.high_freq_factor = r.number(s, "high_freq_factor", 4.0, true);
      rope.scaling.original_max_position_embeddings = original_length();
    }
  }
  rope.head_dim = c.head_dim;
  rope.max_position_embeddings = c.max_position_embeddings;
}

// The RoPE settings as transformers (5.x, which reads 4.x's names too)
// resolves them: a non-empty rope_scaling (4.x's name) replaces
// rope_parameters; rope_theta is the chosen object's, else the top-level
// key's, else 10000; llama3's original_max_position_embeddings is the
// top-level key's, else the object's, else max_position_embeddings. Read any
// other way, a config holding both names, or a theta outside the object,
// would load with other frequencies than transformers gives it, and every
// logit would differ without an error. Gemma 3 has one RoPE per layer type:
// 5.x's rope_parameters {"full_attention": ..., "sliding_attention": ...},
// or 4.x's rope_theta (1e6) and rope_scaling for the full layers and
// rope_local_base_freq (10000) for the sliding ones.
void read_rope(const Reader& r, DecoderConfig& c) {
  const bool gemma3 = c.model_type == "gemma3_text";
  const bool per_layer_type = rope_per_layer_type(c);
  const json* scaling = nullptr;
  if (r.has("rope_scaling")) {
    const json& s = r.j.at("rope_scaling");
    if (!s.is_object()) r.fail("\"rope_scaling\" must be an object or null");
    if (!s.empty()) scaling = &s;
  }
  const json* params = nullptr;
  if (r.has("rope_parameters")) {
    params = &r.j.at("rope_parameters");
    if (!params->is_object()) r.fail("\"rope_parameters\" must be an object");
  }
  const bool per_type =
      params && (params->contains("full_attention") || params->contains("sliding_attention"));
  if (per_type && !per_layer_type) r.fail("per-layer-type \"rope_parameters\" are not supported");
  // Each class's default theta (transformers' default_theta).
  const double default_theta = gemma3                      ? 1e6
                               : c.model_type == "smollm3" ? 2e6
                               : c.model_type == "olmo3"   ? 5e5
                                                           : 10000.0;
  c.rope.theta = r.number(r.j, "rope_theta", default_theta, false);
  if (!per_layer_type) {
    read_rope_object(r, scaling ? scaling : params, c.rope, c);
  } else {
    // Gemma 3's sliding layers have their own base (rope_local_base_freq);
    // OLMo 3's share rope_theta, without the full layers' scaling.
    RopeConfig local;
    local.theta = gemma3 ? r.number(r.j, "rope_local_base_freq", 10000.0, false) : c.rope.theta;
    const auto type_object = [&](const char* type) -> const json* {
      if (!per_type || !params->contains(type) || params->at(type).is_null()) return nullptr;
      if (!params->at(type).is_object())
        r.fail(std::string("\"rope_parameters\" \"") + type + "\" must be an object");
      return &params->at(type);
    };
    // A 4.x rope_scaling applies to the full layers (transformers updates
    // the full_attention parameters with it).
    read_rope_object(r,
                     scaling    ? scaling
                     : per_type ? type_object("full_attention")
                                : params,
                     c.rope, c);
    read_rope_object(r, type_object("sliding_attention"), local, c);
    c.sliding_rope = local;
  }
  // The rotated part of each head: the RoPE object's partial_rotary_factor,
  // else the top-level key's (Phi-4-mini's 0.75), int(head_dim * factor) as
  // transformers takes it; Phi-3 alone splits its heads so.
  const json* object = scaling ? scaling : params;
  const double partial = object && object->contains("partial_rotary_factor") &&
                                 !object->at("partial_rotary_factor").is_null()
                             ? r.number(*object, "partial_rotary_factor", 1, false)
                             : r.number(r.j, "partial_rotary_factor", 1, false);
  if (partial != 1.0) {
    if (c.model_type != "phi3")
      r.fail("\"partial_rotary_factor\" other than 1 is not supported (phi3 only)");
    const double rotated = std::floor(double(c.head_dim) * partial);
    if (!(partial > 0 && partial < 1) || rotated < 2 || std::fmod(rotated, 2) != 0)
      r.fail("\"partial_rotary_factor\" " + std::to_string(partial) + " of head_dim " +
             std::to_string(c.head_dim) + " must rotate an even number of values, >= 2");
    c.rope.head_dim = static_cast<int64_t>(rotated);
  }
  if (r.flag("rope_interleaved", false))
    r.fail("\"rope_interleaved\": true is not supported (transformers' Llama rotates halves)");
}

// num_key_value_heads when config.json has no such key: the model type's
// config class default in transformers (Mistral's 8, Qwen's 32, Gemma's 16,
// Gemma 2's 4, Llama's num_attention_heads); a null one is
// num_attention_heads for all.
int64_t default_kv_heads(const Reader& r, const DecoderConfig& c) {
  if (r.j.contains("num_key_value_heads")) return c.num_attention_heads;
  if (c.model_type == "mistral" || c.model_type == "ministral") return 8;
  if (c.model_type == "exaone4") return 32;
  if (c.model_type == "qwen2" || c.model_type == "qwen3") return 32;
  if (c.model_type == "gemma") return 16;
  if (gemma2_layout(c) || c.model_type == "smollm3") return 4;
  return c.num_attention_heads;
}

// The MLP's activation as each class reads it. Llama, Mistral and Qwen:
// hidden_act, silu. Gemma: hidden_act (transformers 4.x's hidden_activation
// first where set), whose published "gelu" both generations run as the tanh
// approximation. Gemma 2: hidden_activation alone, where "gelu" is the exact
// GELU, which quanta has no kernel for.
GatedAct read_activation(const Reader& r, const DecoderConfig& c) {
  if (!gemma_family(c)) {
    const std::string act = r.text("hidden_act", "silu");
    if (act != "silu") r.fail("hidden_act \"" + act + "\" is not supported (silu)");
    return GatedAct::silu;
  }
  const bool gemma2 = gemma2_layout(c);
  const char* key = gemma2 || r.has("hidden_activation") ? "hidden_activation" : "hidden_act";
  const std::string act = r.text(key, "gelu_pytorch_tanh");
  if (act == "gelu_pytorch_tanh" || (!gemma2 && act == "gelu")) return GatedAct::gelu_tanh;
  r.fail(std::string(key) + " \"" + act + "\" is not supported (gelu_pytorch_tanh" +
         (gemma2 ? ")" : ", or gelu, which Gemma runs as it)"));
}

// A soft-capping value: absent, the class default; null, none; else > 0.
double read_softcap(const Reader& r, const char* key, double fallback) {
  if (!r.j.contains(key)) return fallback;
  if (r.j.at(key).is_null()) return 0;
  const double v = r.number(r.j, key, 0, true);
  if (!(v > 0) || !std::isfinite(v))
    r.fail(std::string("\"") + key + "\" must be a number > 0 or null, got " + r.j.at(key).dump());
  return v;
}

// SmolLM3's layers without RoPE: no_rope_layers (1: rotates, 0: not; at
// least one entry a layer), else every no_rope_layer_interval-th layer (4).
void read_nope_layers(const Reader& r, DecoderConfig& c) {
  const int64_t layers = c.num_hidden_layers;
  c.nope_layers.clear();
  if (r.has("no_rope_layers")) {
    const json& v = r.j.at("no_rope_layers");
    if (!v.is_array() || static_cast<int64_t>(v.size()) < layers)
      r.fail("\"no_rope_layers\" must list 1 (RoPE) or 0 (none) for each of the " +
             std::to_string(layers) + " layers");
    for (int64_t l = 0; l < layers; ++l) {
      const json& e = v[static_cast<size_t>(l)];
      if (e != 0 && e != 1)
        r.fail("\"no_rope_layers\"[" + std::to_string(l) + "] is " + e.dump() + " (1 or 0)");
      c.nope_layers.push_back(e == 0);
    }
  } else {
    const int64_t interval = r.integer("no_rope_layer_interval", 4);
    for (int64_t l = 0; l < layers; ++l) c.nope_layers.push_back((l + 1) % interval == 0);
  }
  if (std::find(c.nope_layers.begin(), c.nope_layers.end(), true) == c.nope_layers.end())
    c.nope_layers.clear();
}

// The layers' types (layer_types, else the class's pattern) of the models
// that have them: true where a layer is sliding_attention.
std::vector<bool> read_layer_types(const Reader& r, const DecoderConfig& c) {
  const int64_t layers = c.num_hidden_layers;
  std::vector<bool> slides;
  if (r.has("layer_types")) {
    const json& types = r.j.at("layer_types");
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      r.fail("\"layer_types\" must list one type per layer (" + std::to_string(layers) + ")");
    for (int64_t i = 0; i < layers; ++i) {
      const json& t = types[static_cast<size_t>(i)];
      if (t != "sliding_attention" && t != "full_attention")
        r.fail("\"layer_types\"[" + std::to_string(i) + "] is " + t.dump() +
               " (full_attention or sliding_attention)");
      slides.push_back(t == "sliding_attention");
    }
    return slides;
  }
  // Gemma 2: every other layer from layer 0; Gemma 3: all but every
  // sliding_window_pattern-th (6); OLMo 3: all but every 4th; SmolLM3: its
  // layers without RoPE, where use_sliding_window and a window are set;
  // Ministral: every layer, unless sliding_window is null; EXAONE 4: all
  // but every sliding_window_pattern-th (4), none when sliding_window is
  // null.
  const bool smollm3_slides =
      r.flag("use_sliding_window", false) && r.has("sliding_window") && !c.nope_layers.empty();
  const bool windowless = r.j.contains("sliding_window") && !r.has("sliding_window");
  if (c.model_type == "exaone4" && !windowless && r.has("sliding_window_pattern") &&
      !r.j.at("sliding_window_pattern").is_number_integer())
    r.fail(
        "a \"sliding_window_pattern\" other than a number needs \"layer_types\" (as "
        "transformers reads it)");
  const int64_t pattern = c.model_type == "gemma2"        ? 2
                          : c.model_type == "gemma3_text" ? r.integer("sliding_window_pattern", 6)
                          : c.model_type == "exaone4"     ? r.integer("sliding_window_pattern", 4)
                                                          : 4;
  for (int64_t l = 0; l < layers; ++l)
    slides.push_back(c.model_type == "gemma2"      ? l % 2 == 0
                     : c.model_type == "smollm3"   ? smollm3_slides && !c.layer_rotates(l)
                     : c.model_type == "ministral" ? !windowless
                     : c.model_type == "exaone4"   ? !windowless && (l + 1) % pattern != 0
                                                   : (l + 1) % pattern != 0);
  return slides;
}

// Sliding-window attention as transformers reads it: mistral's
// sliding_window on every layer (4096 when the key is absent, as
// MistralConfig's default; none when null); qwen2's and qwen3's when
// use_sliding_window, on the layers layer_types names sliding_attention,
// else on those from max_window_layers (28 when absent); the typed layers'
// (Gemma 2 and 3, OLMo 3, SmolLM3) on their sliding_attention layers. Llama
// has none.
void read_sliding_window(const Reader& r, DecoderConfig& c) {
  const int64_t layers = c.num_hidden_layers;
  const auto window = [&]() -> int64_t {
    if (!r.j.contains("sliding_window")) return 4096;
    return r.has("sliding_window") ? r.integer("sliding_window") : 0;
  };
  int64_t w = 0, first = layers;  // the window, and the first layer that slides
  if (c.model_type == "mistral" || c.model_type == "phi3") {
    // Phi3Config's default is no window (Mistral's 4096).
    w = c.model_type == "phi3" && !r.j.contains("sliding_window") ? 0 : window();
    first = 0;
  } else if (typed_layers(c)) {
    const std::vector<bool> slides = read_layer_types(r, c);
    const bool any_slides = std::find(slides.begin(), slides.end(), true) != slides.end();
    if (c.model_type == "smollm3") {
      // Its attention slides only with use_sliding_window, while
      // transformers' mask follows layer_types alone: a config where the
      // two disagree computes differently in each attention implementation.
      const bool windowed = r.flag("use_sliding_window", false) && r.has("sliding_window");
      if (any_slides && !windowed)
        r.fail(
            "\"layer_types\" names sliding_attention layers but use_sliding_window is not true "
            "with a sliding_window (transformers' attention and its mask then disagree)");
      w = windowed ? r.integer("sliding_window") : 0;
    } else {
      w = window();
    }
    // Kept without a window too: Gemma 3's and OLMo 3's sliding layers take
    // their RoPE whether or not they slide.
    c.sliding_layers = slides;
    const auto first_sliding = std::find(slides.begin(), slides.end(), true);
    if (w > 0 && first_sliding != slides.end()) {
      c.sliding_window = w;
      c.max_window_layers = first_sliding - slides.begin();
    }
    return;
  } else if (qwen_windows(c) && r.flag("use_sliding_window", false)) {
    w = window();
    first = std::min<int64_t>(28, layers);
    if (r.has("max_window_layers")) {
      const json& v = r.j.at("max_window_layers");
      if (!v.is_number_integer() || v.get<int64_t>() < 0)
        r.fail("\"max_window_layers\" must be an integer >= 0, got " + v.dump());
      first = std::min(v.get<int64_t>(), layers);
    }
  }
  if (r.has("layer_types")) {
    const json& types = r.j.at("layer_types");
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      r.fail("\"layer_types\" must list one type per layer (" + std::to_string(layers) + ")");
    int64_t first_listed = layers;
    for (size_t i = 0; i < types.size(); ++i) {
      const json& t = types[i];
      const std::string kind = t.is_string() ? t.get<std::string>() : "";
      // "attention" is the name transformers gave full attention before.
      const bool full = kind == "full_attention" || kind == "attention";
      const bool sliding = kind == "sliding_attention";
      // Only Qwen's layers follow layer_types; Llama and Mistral take no
      // per-layer kinds, so one other than full attention is refused.
      if (!full && !(sliding && qwen_windows(c)))
        r.fail("\"layer_types\" holds " + t.dump() + "; only full_attention is supported" +
               (qwen_windows(c) ? " (and sliding_attention)" : ""));
      if (sliding && first_listed == layers) first_listed = static_cast<int64_t>(i);
      if (full && first_listed < layers && w > 0)
        r.fail(
            "sliding-window layers other than the last ones (from one layer on) are not "
            "supported");
    }
    if (qwen_windows(c)) first = first_listed;
  }
  if (w == 0 || first >= layers) return;
  c.sliding_window = w;
  c.max_window_layers = first;
  for (int64_t l = 0; l < layers; ++l) c.sliding_layers.push_back(l >= first);
}

}  // namespace

double DecoderConfig::attention_scale() const {
  if (attention_multiplier > 0) return attention_multiplier;
  return std::pow(static_cast<double>(query_pre_attn_scalar > 0 ? query_pre_attn_scalar : head_dim),
                  -0.5);
}

bool DecoderConfig::layer_rotates(int64_t layer) const {
  return layer < 0 || layer >= static_cast<int64_t>(nope_layers.size()) ||
         !nope_layers[static_cast<size_t>(layer)];
}

bool DecoderConfig::layer_slides(int64_t layer) const {
  return layer >= 0 && layer < static_cast<int64_t>(sliding_layers.size()) &&
         sliding_layers[static_cast<size_t>(layer)];
}

int64_t DecoderConfig::layer_window(int64_t layer) const {
  return layer_slides(layer) ? sliding_window : 0;
}

RmsWeight DecoderConfig::norm_weight() const {
  if (gemma_norms) return RmsWeight::one_plus;
  return olmo2_layout(*this) ? RmsWeight::in_accumulation : RmsWeight::rounded_first;
}

std::string DecoderConfig::decoder_module() const {
  return image_text_config.empty() ? "model" : "model.language_model";
}

int64_t DecoderConfig::parameter_count() const {
  const int64_t q = num_attention_heads * head_dim, kv = num_key_value_heads * head_dim;
  int64_t layer = hidden_size * (q + 2 * kv) + q * hidden_size;  // q, k, v, o
  if (qkv_bias) layer += q + 2 * kv;
  if (o_bias) layer += hidden_size;
  layer += 3 * hidden_size * intermediate_size;  // gate, up, down
  if (mlp_bias) layer += 2 * intermediate_size + hidden_size;
  layer += (sandwich_norms ? 4 : 2) * hidden_size;  // the norms
  if (qk_norm) layer += qk_norm_whole ? q + kv : 2 * head_dim;
  const int64_t embed = vocab_size * hidden_size;
  return embed * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + hidden_size;
}

namespace {

// Gemma 3's image-text config (Gemma3ForConditionalGeneration): the decoder
// is its text_config, which the published folders write sparsely (the 4B's
// names only its widths, depth, window and RoPE scaling), so
// Gemma3TextConfig's defaults fill the rest as transformers fills them. The
// dtype is the outer config's where text_config has none, and the tying is
// the outer config's: the outer model ties lm_head by its own flag.
DecoderConfig parse_gemma3_image_text(json j, const std::string& source) {
  const Reader r{j, source};
  json text = r.has("text_config") ? j.at("text_config") : json::object();
  if (!text.is_object()) r.fail("\"text_config\" must be an object");
  if (text.contains("model_type") && text.at("model_type") != "gemma3_text")
    r.fail("text_config's model_type is " + text.at("model_type").dump() +
           " (Gemma 3's decoder is \"gemma3_text\")");
  static const json defaults = {{"model_type", "gemma3_text"},
                                {"vocab_size", 262208},
                                {"hidden_size", 2304},
                                {"intermediate_size", 9216},
                                {"num_hidden_layers", 26},
                                {"num_attention_heads", 8},
                                {"num_key_value_heads", 4},
                                {"head_dim", 256},
                                {"max_position_embeddings", 131072}};
  for (const auto& [key, value] : defaults.items())
    if (!text.contains(key)) text[key] = value;
  if (!text.contains("dtype") && !text.contains("torch_dtype"))
    for (const char* key : {"dtype", "torch_dtype"})
      if (r.has(key)) {
        text[key] = j.at(key);
        break;
      }
  text["tie_word_embeddings"] = r.flag("tie_word_embeddings", true);
  DecoderConfig c = parse_decoder_config(text.dump(), source + " text_config");
  // Only the text-only class caps its logits: this one computes them
  // without the cap whatever text_config says (some published configs say
  // 30), so quanta does too.
  c.final_logit_softcapping = 0;
  // Kept without what the decoder's config holds (written back from it).
  for (const char* key : {"text_config", "dtype", "torch_dtype", "tie_word_embeddings"})
    j.erase(key);
  c.image_text_config = j.dump();
  return c;
}

}  // namespace

DecoderConfig parse_decoder_config(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw std::invalid_argument(source + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw std::invalid_argument(source + ": not a JSON object");
  const Reader r{j, source};
  DecoderConfig c;
  c.model_type = r.text("model_type", "");
  if (c.model_type == "gemma3") return parse_gemma3_image_text(j, source);
  static const char* const kTypes[] = {"llama",   "mistral",     "qwen2",     "qwen3",  "gemma",
                                       "gemma2",  "gemma3_text", "phi3",      "olmo2",  "olmo3",
                                       "smollm3", "granite",     "ministral", "exaone4"};
  if (std::find(std::begin(kTypes), std::end(kTypes), c.model_type) == std::end(kTypes))
    r.fail("model_type \"" + c.model_type +
           "\" is not supported (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, "
           "gemma3, phi3, olmo2, olmo3, smollm3, granite, ministral, exaone4)");
  const bool qwen3 = c.model_type == "qwen3", gemma = gemma_family(c);
  c.hidden_act = read_activation(r, c);
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.intermediate_size = r.integer("intermediate_size");
  c.num_hidden_layers = r.integer("num_hidden_layers");
  c.num_attention_heads = r.integer("num_attention_heads");
  c.num_key_value_heads = r.integer("num_key_value_heads", default_kv_heads(r, c));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_attention_heads " + std::to_string(c.num_attention_heads) +
           " is not a multiple of num_key_value_heads " + std::to_string(c.num_key_value_heads) +
           (r.j.contains("num_key_value_heads")
                ? ""
                : " (the key is absent: transformers' default for " + c.model_type + ")"));
  // Qwen3Config's head_dim defaults to 128 whatever the width, Gemma's to
  // 256.
  const int64_t class_head_dim = qwen3 ? 128 : gemma ? 256 : 0;
  if (!class_head_dim && !r.has("head_dim") && c.hidden_size % c.num_attention_heads != 0)
    r.fail("hidden_size is not a multiple of num_attention_heads and there is no head_dim");
  c.head_dim = r.integer("head_dim",
                         class_head_dim ? class_head_dim : c.hidden_size / c.num_attention_heads);
  if (c.head_dim % 2 != 0) r.fail("head_dim must be even, got " + std::to_string(c.head_dim));
  if (c.head_dim > kMaxHeadDim)
    r.fail("head_dim " + std::to_string(c.head_dim) + " is more than any model has (at most " +
           std::to_string(kMaxHeadDim) + ")");
  c.max_position_embeddings = r.integer("max_position_embeddings");
  const auto check_weight = [&](const char* rows, int64_t r_n, const char* cols, int64_t c_n) {
    if (r_n > kMaxWeightElements / c_n)
      r.fail(std::string("a [") + rows + ", " + cols + "] weight of " + std::to_string(r_n) +
             " x " + std::to_string(c_n) + " elements is more than quanta loads (2^40)");
  };
  check_weight("vocab_size", c.vocab_size, "hidden_size", c.hidden_size);
  check_weight("intermediate_size", c.intermediate_size, "hidden_size", c.hidden_size);
  if (c.num_attention_heads > kMaxSize / c.head_dim)
    r.fail("num_attention_heads x head_dim is more than any model has");
  check_weight("num_attention_heads x head_dim", c.num_attention_heads * c.head_dim, "hidden_size",
               c.hidden_size);
  // Phi-3's and OLMo's classes default to 1e-5, the others to 1e-6.
  c.rms_norm_eps = r.number(
      j, "rms_norm_eps",
      c.model_type == "phi3" || c.model_type == "exaone4" || olmo2_layout(c) ? 1e-5 : 1e-6, false);
  if (!(c.rms_norm_eps >= 0)) r.fail("\"rms_norm_eps\" must be >= 0");
  // Gemma's and SmolLM3's classes tie by default, the others not.
  c.tie_word_embeddings = r.flag("tie_word_embeddings", gemma || c.model_type == "smollm3");
  // Biases as each model's modules have them: Llama's and SmolLM3's
  // attention_bias and mlp_bias; Qwen3's, Gemma's and OLMo's
  // attention_bias (their MLPs have none);
  // Qwen2's q, k and v always, nothing else; Mistral none. A key a model
  // does not read is ignored, as transformers ignores it.
  const bool llama =
      c.model_type == "llama" || c.model_type == "smollm3" || c.model_type == "granite";
  const bool olmo = olmo2_layout(c);
  c.attention_bias = (llama || qwen3 || gemma || olmo) && r.flag("attention_bias", false);
  c.mlp_bias = llama && r.flag("mlp_bias", false);
  c.qkv_bias = c.model_type == "qwen2" || c.attention_bias;
  c.o_bias = c.attention_bias;
  c.fused_projections = c.model_type == "phi3";
  // Qwen3 and Gemma 3 normalize each head of q and k (Gemma 3 with 1 +
  // weight, as its other norms).
  const bool exaone4 = c.model_type == "exaone4";
  c.qk_norm = qwen3 || c.model_type == "gemma3_text" || olmo || exaone4;
  // OLMo 2 and 3: over all heads at once; their norms only after each
  // block, as EXAONE 4's (whose q and k norms are Qwen3's, per head).
  c.qk_norm_whole = olmo;
  c.post_norms = olmo || exaone4;
  c.gemma_norms = gemma;
  if (gemma2_layout(c)) {
    // Gemma 2 caps by default, Gemma 3 does not.
    const bool gemma2 = c.model_type == "gemma2";
    c.sandwich_norms = true;
    c.query_pre_attn_scalar = r.integer("query_pre_attn_scalar", 256);
    c.attn_logit_softcapping = read_softcap(r, "attn_logit_softcapping", gemma2 ? 50.0 : 0);
    c.final_logit_softcapping = read_softcap(r, "final_logit_softcapping", gemma2 ? 30.0 : 0);
  }
  if (c.model_type == "granite") {
    // Granite's scalings of the embeddings, the residual branches, the
    // attention scores and the logits (GraniteConfig's defaults 1: the
    // scores unscaled by head_dim).
    const auto multiplier = [&](const char* key) {
      const double v = r.number(j, key, 1.0, false);
      if (!(v > 0) || !std::isfinite(v))
        r.fail(std::string("\"") + key + "\" must be a number > 0, got " + j.at(key).dump());
      return v;
    };
    c.embedding_multiplier = multiplier("embedding_multiplier");
    c.residual_multiplier = multiplier("residual_multiplier");
    c.attention_multiplier = multiplier("attention_multiplier");
    c.logits_scaling = multiplier("logits_scaling");
  }
  // Embedding models built on Gemma attend both ways; a causal LM does not.
  if (r.flag("use_bidirectional_attention", false))
    r.fail(
        "\"use_bidirectional_attention\": true is not supported (a causal language model "
        "attends to earlier tokens only)");
  c.dtype = dtype_of(r);
  if (r.has("pretraining_tp") && r.integer("pretraining_tp") < 1) r.fail("bad pretraining_tp");
  // transformers drops attention probabilities while training when it is
  // set; quanta's attention has no dropout, so a fine-tune would differ.
  if (r.number(j, "attention_dropout", 0.0, false) != 0.0)
    r.fail("\"attention_dropout\": " + j.at("attention_dropout").dump() +
           " is not supported (quanta's attention has no dropout; 0 is)");
  // Phi-3's dropouts on the residual branches and the embeddings, likewise.
  if (c.model_type == "phi3")
    for (const char* key : {"resid_pdrop", "embd_pdrop"})
      if (r.number(j, key, 0.0, false) != 0.0)
        r.fail(std::string("\"") + key + "\": " + j.at(key).dump() +
               " is not supported (quanta's decoder has no dropout there; 0 is)");
  if (c.model_type == "smollm3") read_nope_layers(r, c);
  read_sliding_window(r, c);
  // EXAONE 4: with a sliding_window, its full layers attend without RoPE.
  if (c.model_type == "exaone4" && !(r.j.contains("sliding_window") && !r.has("sliding_window"))) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.nope_layers.push_back(!c.layer_slides(l));
    if (std::find(c.nope_layers.begin(), c.nope_layers.end(), true) == c.nope_layers.end())
      c.nope_layers.clear();
  }
  read_rope(r, c);
  // Every RoPE value checked now, not at the first forward (longrope's long
  // factors too: a length past the original picks them).
  try {
    for (const int64_t len : {int64_t(0), kMaxSize}) {
      rope_frequencies(c.rope, len);
      if (c.sliding_rope) rope_frequencies(*c.sliding_rope, len);
    }
  } catch (const std::invalid_argument& e) {
    r.fail(e.what());
  }
  return c;
}

DecoderConfig read_decoder_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open (a model folder holds config.json)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_decoder_config(ss.str(), path);
}

std::string decoder_config_json(const DecoderConfig& c) {
  json j;
  j["model_type"] = c.model_type;
  j["architectures"] = {c.model_type == "qwen2"         ? "Qwen2ForCausalLM"
                        : c.model_type == "qwen3"       ? "Qwen3ForCausalLM"
                        : c.model_type == "mistral"     ? "MistralForCausalLM"
                        : c.model_type == "gemma"       ? "GemmaForCausalLM"
                        : c.model_type == "gemma2"      ? "Gemma2ForCausalLM"
                        : c.model_type == "gemma3_text" ? "Gemma3ForCausalLM"
                        : c.model_type == "phi3"        ? "Phi3ForCausalLM"
                        : c.model_type == "olmo2"       ? "Olmo2ForCausalLM"
                        : c.model_type == "olmo3"       ? "Olmo3ForCausalLM"
                        : c.model_type == "smollm3"     ? "SmolLM3ForCausalLM"
                        : c.model_type == "granite"     ? "GraniteForCausalLM"
                        : c.model_type == "ministral"   ? "MinistralForCausalLM"
                        : c.model_type == "exaone4"     ? "Exaone4ForCausalLM"
                                                        : "LlamaForCausalLM"};
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  const char* act = c.hidden_act == GatedAct::silu ? "silu" : "gelu_pytorch_tanh";
  j["hidden_act"] = act;
  if (gemma2_layout(c)) j["hidden_activation"] = act;
  // A RoPE's scaling as a rope_scaling object (null for none).
  const auto scaling_json = [](const RopeConfig& rope) -> json {
    if (rope.scaling.type == "default") return nullptr;
    json s{{"rope_type", rope.scaling.type}, {"factor", rope.scaling.factor}};
    if (rope.scaling.type == "llama3") {
      s["low_freq_factor"] = rope.scaling.low_freq_factor;
      s["high_freq_factor"] = rope.scaling.high_freq_factor;
      s["original_max_position_embeddings"] = rope.scaling.original_max_position_embeddings;
    }
    const RopeScaling& r = rope.scaling;
    if (r.type == "longrope" || r.type == "yarn") {
      if (!(r.factor > 0)) s.erase("factor");  // derived, as it was read
      if (r.attention_factor > 0) s["attention_factor"] = r.attention_factor;
    }
    if (r.type == "longrope") {
      s["short_factor"] = r.short_factor;
      s["long_factor"] = r.long_factor;
    }
    if (r.type == "yarn") {
      s["original_max_position_embeddings"] = r.original_max_position_embeddings;
      if (r.beta_fast != 0) s["beta_fast"] = r.beta_fast;
      if (r.beta_slow != 0) s["beta_slow"] = r.beta_slow;
      if (r.mscale != 0) s["mscale"] = r.mscale;
      if (r.mscale_all_dim != 0) s["mscale_all_dim"] = r.mscale_all_dim;
      if (!r.truncate) s["truncate"] = false;
    }
    return s;
  };
  j["rope_theta"] = c.rope.theta;
  j["rope_scaling"] = scaling_json(c.rope);
  if (c.model_type == "phi3") {
    j["partial_rotary_factor"] = double(c.rope.head_dim) / double(c.head_dim);
    if (c.rope.scaling.type == "longrope")
      j["original_max_position_embeddings"] = c.rope.scaling.original_max_position_embeddings;
  }
  if (c.sliding_rope) {
    // Gemma 3: 4.x's local base and 5.x's per-type parameters, which also
    // carry a scaling of the sliding layers (OLMo 3: the latter alone).
    if (c.model_type == "gemma3_text") j["rope_local_base_freq"] = c.sliding_rope->theta;
    json per_type;
    for (const auto& [type, rope] :
         {std::pair<const char*, const RopeConfig*>{"full_attention", &c.rope},
          {"sliding_attention", &*c.sliding_rope}}) {
      json o = scaling_json(*rope);
      if (o.is_null()) o = json{{"rope_type", "default"}};
      o["rope_theta"] = rope->theta;
      per_type[type] = o;
    }
    j["rope_parameters"] = per_type;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  const bool llama_biases =
      c.model_type == "llama" || c.model_type == "smollm3" || c.model_type == "granite";
  if (llama_biases || c.model_type == "qwen3" || olmo2_layout(c) || gemma_family(c))
    j["attention_bias"] = c.attention_bias;
  if (c.model_type == "granite") {
    j["embedding_multiplier"] = c.embedding_multiplier;
    j["residual_multiplier"] = c.residual_multiplier;
    j["attention_multiplier"] = c.attention_multiplier;
    j["logits_scaling"] = c.logits_scaling;
  }
  if (gemma2_layout(c)) {
    j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
    const auto cap = [](double v) { return v > 0 ? json(v) : json(nullptr); };
    j["attn_logit_softcapping"] = cap(c.attn_logit_softcapping);
    j["final_logit_softcapping"] = cap(c.final_logit_softcapping);
  }
  if (llama_biases) j["mlp_bias"] = c.mlp_bias;
  const json window = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  if (c.model_type == "mistral" || c.model_type == "phi3" || typed_layers(c))
    j["sliding_window"] = window;
  if (c.model_type == "smollm3") {
    j["use_sliding_window"] = c.sliding_window > 0;
    json rotates = json::array();
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) rotates.push_back(c.layer_rotates(l) ? 1 : 0);
    j["no_rope_layers"] = rotates;
  }
  if (typed_layers(c)) {
    json types = json::array();
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      types.push_back(c.layer_slides(l) ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  if (qwen_windows(c)) {
    j["use_sliding_window"] = c.sliding_window > 0;
    j["sliding_window"] = window;
    j["max_window_layers"] = c.sliding_window > 0 ? c.max_window_layers : c.num_hidden_layers;
  }
  j["torch_dtype"] = torch_dtype_name(c.dtype);
  if (c.image_text_config.empty()) return j.dump(2) + "\n";
  // The image-text model's config around this one as its text_config,
  // with the dtype and tying the outer model reads.
  json outer = json::parse(c.image_text_config);
  j.erase("architectures");
  outer["text_config"] = j;
  outer["torch_dtype"] = j["torch_dtype"];
  outer["tie_word_embeddings"] = c.tie_word_embeddings;
  return outer.dump(2) + "\n";
}

const char* torch_dtype_name(DType dtype) {
  if (!is_floating(dtype))
    throw std::invalid_argument(std::string("dtype ") + dtype_name(dtype) +
                                " is not a model dtype (float32, bfloat16, float16, float64)");
  return torch_name(dtype);
}

DType dtype_from_torch_name(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  if (name == "float16") return DType::f16;
  if (name == "float64") return DType::f64;  // rare in the wild; exact references in tests
  throw std::invalid_argument("dtype \"" + name +
                              "\" is not one quanta loads (float32, bfloat16, float16, float64)");
}

}  // namespace quanta::llm
