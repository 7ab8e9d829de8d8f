#include "train/quantizer_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

namespace quanta::train {
namespace {

// The VectorQuantize layers, alone or stacked: their codebook options.
const std::vector<std::string> kVqFamily = {"vq", "rvq", "grvq", "hvq"};

std::vector<std::string> with(std::vector<std::string> a, std::vector<std::string> b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string type_word(const QuantizerOption& o) {
  if (o.type == OptionType::choice) {
    std::string words = "one of ";
    for (size_t i = 0; i < o.choices.size(); ++i) words += (i ? ", " : "") + o.choices[i];
    return words;
  }
  switch (o.type) {
    case OptionType::integer:
      return "an integer";
    case OptionType::number:
      return "a number";
    case OptionType::boolean:
      return "true or false";
    default:
      return "a list of positive integers like 8,5,5,5";
  }
}

std::string short_dump(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

// Integer options are sizes and counts; far above any real one, low enough
// that a codebook's element count cannot overflow.
constexpr int64_t kMaxIntegerOption = int64_t{1} << 24;

// An integer JSON value in [lo, hi] (JSON's non-negative integers are held
// unsigned).
bool integer_in(const nlohmann::json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned())
    return v.get<uint64_t>() >= uint64_t(std::max<int64_t>(lo, 0)) &&
           v.get<uint64_t>() <= uint64_t(hi);
  return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
}

// Options whose integer values are sizes or counts, so must be positive
// (share_quant_resi 0: one Phi per level).
bool must_be_positive(const std::string& key) {
  return key != "kmeans_iters" && key != "share_quant_resi";
}

// Number options that are fractions, so at most 1.
bool is_fraction(const std::string& key) { return key == "decay" || key == "nested_dropout"; }

}  // namespace

const std::vector<std::pair<std::string, std::string>>& quantizer_types() {
  static const std::vector<std::pair<std::string, std::string>> types = {
      {"none", "no quantization: a plain autoencoder (baseline)"},
      {"vq", "VectorQuantize: nearest code in a learned codebook"},
      {"rvq", "ResidualVQ: a stack of VQs on the residuals"},
      {"grvq", "GroupedResidualVQ: residual VQ per channel group"},
      {"simvq", "SimVQ: a frozen codebook through a learned linear map"},
      {"fsq", "FSQ: finite scalar quantization on fixed levels"},
      {"fsp", "FSP: finite scalar perturbation, CDF bins with in-bin noise while training"},
      {"rfsq", "ResidualFSQ: a stack of FSQs on the residuals"},
      {"lfq", "LFQ: lookup-free (binary) quantization"},
      {"rlfq", "ResidualLFQ: a stack of LFQs on the residuals"},
      {"hvq", "HierarchicalVQ: VAR-style multi-scale residual VQ, coarse to fine levels"},
  };
  return types;
}

const std::vector<QuantizerOption>& quantizer_options() {
  using T = OptionType;
  static const std::vector<QuantizerOption> options = {
      {"codebook_size", T::integer, "codes per codebook (LFQ: a power of two)",
       with(kVqFamily, {"simvq", "lfq", "rlfq"})},
      {"codebook_dim", T::integer,
       "code vector size (projections in and out when it "
       "differs from the latent dim)",
       with(kVqFamily, {"simvq"})},
      {"levels", T::integer_list, "FSQ levels per dimension, e.g. 8,5,5,5", {"fsq", "fsp", "rfsq"}},
      {"num_quantizers", T::integer, "residual quantizer levels", {"rvq", "grvq", "rfsq", "rlfq"}},
      {"groups", T::integer, "channel groups", {"grvq"}},
      {"heads", T::integer, "heads (the latent split into this many parts)", {"vq"}},
      {"num_codebooks", T::integer, "codebooks side by side", {"fsq", "lfq"}},
      {"decay", T::number, "EMA decay of the codebook", kVqFamily},
      {"eps", T::number, "EMA epsilon (Laplace smoothing)", kVqFamily},
      {"kmeans_init", T::boolean, "initialise the codebook by k-means on the first batch",
       kVqFamily},
      {"kmeans_iters", T::integer, "k-means iterations", kVqFamily},
      {"threshold_ema_dead_code", T::number,
       "replace codes whose EMA cluster size falls below this", kVqFamily},
      {"commitment_weight", T::number, "weight of the commitment loss", with(kVqFamily, {"simvq"})},
      {"use_cosine_sim", T::boolean, "cosine-similarity codebook (l2-normalised)", kVqFamily},
      {"orthogonal_reg_weight", T::number, "weight of the orthogonal regulariser", kVqFamily},
      {"learnable_codebook", T::boolean, "train the codebook by gradient", kVqFamily},
      {"ema_update", T::boolean, "update the codebook by EMA", kVqFamily},
      {"rotation_trick", T::boolean, "rotation-trick gradient instead of straight-through",
       with(kVqFamily, {"simvq"})},
      {"directional_reparam",
       T::boolean,
       "DiVeQ: codes learn through the output (x moved by |q - x| along a noisy error "
       "direction); needs threshold_ema_dead_code",
       {"vq"}},
      {"directional_reparam_variance", T::number, "DiVeQ's noise variance (default 0.005)",
       kVqFamily},
      {"diveq",
       T::boolean,
       "DiVeQ over the residual stack: codes learn by gradient, the summed output is "
       "reparameterised",
       {"rvq", "grvq"}},
      {"quant_grad_frac",
       T::number,
       "fraction of later levels' gradient that reaches a level's output (0 to 1)",
       {"rvq", "grvq"}},
      {"beam_size",
       T::integer,
       "beam search over residual codes while training (paths kept)",
       {"rvq", "grvq"}},
      {"eval_beam_size",
       T::integer,
       "beam search paths in evaluation (default: beam_size)",
       {"rvq", "grvq"}},
      {"implicit_neural_codebook",
       T::boolean,
       "QINCo: levels after the first quantize with an MLP of each code and the running sum "
       "(a codebook per token; memory grows with tokens x codebook_size)",
       {"rvq", "grvq"}},
      {"mlp_depth", T::integer, "QINCo's MLP residual blocks (default 4)", {"rvq", "grvq"}},
      {"mlp_dim_hidden",
       T::integer,
       "QINCo's MLP hidden width (default: the code size)",
       {"rvq", "grvq"}},
      {"shared_codebook",
       T::boolean,
       "one codebook for every residual level",
       {"rvq", "grvq", "hvq"}},
      {"scales",
       T::integer_list,
       "HierarchicalVQ's level sides, coarse to fine, non-decreasing, at most the latent's 7 "
       "(e.g. 1,2,4,7)",
       {"hvq"}},
      {"quant_resi",
       T::number,
       "HierarchicalVQ: weight of Phi's convolution on each upsampled level (0: none)",
       {"hvq"}},
      {"share_quant_resi",
       T::integer,
       "HierarchicalVQ: Phi convolutions shared by the levels (1: one; 0: one per level)",
       {"hvq"}},
      {"nested_dropout",
       T::number,
       "HierarchicalVQ, training: probability of keeping only the coarsest levels (0 to 1)",
       {"hvq"}},
      {"nested_dropout_min_levels",
       T::integer,
       "HierarchicalVQ: levels nested dropout always keeps",
       {"hvq"}},
      {"quantize_dropout",
       T::boolean,
       "drop trailing residual levels while training",
       {"rvq", "grvq", "rfsq", "rlfq"}},
      {"preserve_symmetry",
       T::boolean,
       "FSQ's symmetric grid, levels at 2k/(L-1) - 1 (arXiv 2411.19842)",
       {"fsq", "rfsq"}},
      {"noise_dropout",
       T::number,
       "training: the fraction of code elements that get U(-1/2, 1/2) noise added (then "
       "clamped to [-1, 1]); needs preserve_symmetry",
       {"fsq", "rfsq"}},
      {"bound_hard_clamp",
       T::boolean,
       "bound the latent by clamp(z, -1, 1) instead of tanh",
       {"fsq", "rfsq"}},
      {"act_name",
       T::choice,
       "FSP's CDF activation",
       {"fsp"},
       {"tanh", "sigmoid", "normal", "laplace", "cauchy"}},
      {"quantize_rate",
       T::number,
       "FSP: the fraction of elements quantized while training (the rest perturbed; 0 to 1)",
       {"fsp"}},
      {"need_inv_act",
       T::boolean,
       "FSP: the code is the activation's inverse at the bin midpoint",
       {"fsp"}},
      {"vector_norm",
       T::choice,
       "FSP's batch-statistics loss preset",
       {"fsp"},
       {"none", "var", "kurt", "var_tanh", "var_sigmoid", "var_laplace"}},
      {"entropy_loss_weight", T::number, "weight of the entropy loss", {"lfq", "rlfq"}},
      {"commitment_loss_weight", T::number, "weight of the commitment loss", {"lfq", "rlfq"}},
      {"diversity_gamma", T::number, "weight of the codebook-entropy term", {"lfq", "rlfq"}},
      {"spherical",
       T::boolean,
       "l2-normalise the input and the codes (codes on the sphere of radius codebook_scale)",
       {"lfq", "rlfq"}},
      {"frac_per_sample_entropy",
       T::number,
       "fraction of the tokens the per-sample entropy is estimated on (1: all)",
       {"lfq", "rlfq"}},
  };
  return options;
}

std::string available_quantizer_types() {
  std::string names;
  for (const auto& [name, _] : quantizer_types()) names += (names.empty() ? "" : ", ") + name;
  return names;
}

bool option_applies(const std::string& key, const std::string& type) {
  for (const QuantizerOption& o : quantizer_options())
    if (o.key == key) return std::find(o.types.begin(), o.types.end(), type) != o.types.end();
  return false;
}

std::string flag_name(const std::string& key) {
  std::string s = key;
  std::replace(s.begin(), s.end(), '_', '-');
  return s;
}

void validate_quantizer_config(const nlohmann::json& config) {
  if (!config.is_object())
    throw std::invalid_argument("[config] \"quantizer\" must be an object, got " +
                                short_dump(config));
  if (!config.contains("type") || !config["type"].is_string())
    throw std::invalid_argument("[config] \"quantizer\" needs a string \"type\" (one of " +
                                available_quantizer_types() + ")");
  const std::string type = config["type"].get<std::string>();
  std::string names;
  bool known = false;
  for (const auto& [name, _] : quantizer_types()) {
    names += (names.empty() ? "" : ", ") + name;
    known = known || name == type;
  }
  if (!known)
    throw std::invalid_argument("[config] unknown quantizer type '" + type + "' (types: " + names +
                                ")");
  for (const auto& [key, value] : config.items()) {
    if (key == "type") continue;
    const auto& opts = quantizer_options();
    auto it = std::find_if(opts.begin(), opts.end(),
                           [&](const QuantizerOption& o) { return o.key == key; });
    if (it == opts.end())
      throw std::invalid_argument("[config] unknown quantizer option '" + key + "'");
    if (std::find(it->types.begin(), it->types.end(), type) == it->types.end())
      throw std::invalid_argument("[config] quantizer option '" + key +
                                  "' does not apply to quantizer '" + type + "'");
    bool ok = false;
    switch (it->type) {
      case OptionType::integer:
        ok = integer_in(value, must_be_positive(key) ? 1 : 0, kMaxIntegerOption);
        break;
      case OptionType::number:
        ok = value.is_number() && std::isfinite(value.get<double>()) && value.get<double>() >= 0;
        // eps smooths a division (0 lets a dead code divide by zero); decay
        // is a fraction.
        if (ok && key == "eps") ok = value.get<double>() > 0;
        if (ok && is_fraction(key)) ok = value.get<double>() <= 1;
        break;
      case OptionType::boolean:
        ok = value.is_boolean();
        break;
      case OptionType::integer_list:
        ok = value.is_array() && !value.empty();
        for (const auto& v : value) ok = ok && integer_in(v, 1, kMaxIntegerOption);
        break;
      case OptionType::choice:
        ok = value.is_string() && std::find(it->choices.begin(), it->choices.end(),
                                            value.get<std::string>()) != it->choices.end();
        break;
    }
    if (!ok) {
      std::string want = type_word(*it);
      if (it->type == OptionType::integer)
        want += value.is_number_integer() && !integer_in(value, INT64_MIN, kMaxIntegerOption)
                    ? " <= " + std::to_string(kMaxIntegerOption)
                : must_be_positive(key) ? " > 0"
                                        : " >= 0";
      if (it->type == OptionType::number)
        want += key == "eps" ? " > 0" : is_fraction(key) ? " from 0 to 1" : " >= 0";
      throw std::invalid_argument("[config] quantizer option '" + key + "' must be " + want +
                                  ", got " + short_dump(value));
    }
  }
}

nlohmann::json parse_option_value(const QuantizerOption& opt, const std::string& text) {
  auto bad = [&]() -> std::invalid_argument {
    return std::invalid_argument("--" + flag_name(opt.key) + ": expected " + type_word(opt) +
                                 ", got '" + text + "'");
  };
  auto parse_int = [&](const std::string& s) {
    if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos)
      throw bad();
    return static_cast<int64_t>(std::stoll(s));
  };
  switch (opt.type) {
    case OptionType::integer:
      return parse_int(text);
    case OptionType::number: {
      errno = 0;
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || errno != 0 || !std::isfinite(v)) throw bad();
      return v;
    }
    case OptionType::boolean:
      if (text == "true" || text == "1" || text == "on" || text == "yes") return true;
      if (text == "false" || text == "0" || text == "off" || text == "no") return false;
      throw bad();
    case OptionType::choice:
      if (std::find(opt.choices.begin(), opt.choices.end(), text) == opt.choices.end()) throw bad();
      return text;
    default: {
      nlohmann::json list = nlohmann::json::array();
      size_t start = 0;
      for (;;) {
        const size_t comma = text.find(',', start);
        list.push_back(parse_int(text.substr(start, comma - start)));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      return list;
    }
  }
}

}  // namespace quanta::train
