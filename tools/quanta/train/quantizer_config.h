#pragma once
// The "quantizer" object of a training config: which layer ("type") and its
// options, named as in vector-quantize-pytorch so configs port over. One
// table lists every option with its JSON type and the types that take it;
// the kebab-case command-line flags (--codebook-size) are made from it.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace quanta::train {

/** The JSON type an option value must have. */
enum class OptionType { integer, number, boolean, integer_list, choice };

/** One quantizer option: its key ("codebook_size"), value type, help text,
 * the quantizer types that accept it and, for a choice, its values. */
struct QuantizerOption {
  std::string key;
  OptionType type;
  std::string help;
  std::vector<std::string> types;
  std::vector<std::string> choices = {};
};

/** Every quantizer type name, "none" first, with a one-line description. */
const std::vector<std::pair<std::string, std::string>>& quantizer_types();
/** Every option of every type, in the order --help lists them. */
const std::vector<QuantizerOption>& quantizer_options();
/** The types make_quantizer can build in this build, comma-separated. */
std::string available_quantizer_types();

/** Whether `key` is an option of quantizer type `type` (quantizer_options()). */
bool option_applies(const std::string& key, const std::string& type);

/** The flag spelling of an option key: codebook_size -> codebook-size. */
std::string flag_name(const std::string& key);

/** Checks a "quantizer" object: an object with a known string "type" and
 * only options that type takes, each of its declared JSON type (integers and
 * lists positive where sizes are meant). Throws std::invalid_argument with
 * one line naming the option and what is wrong. */
void validate_quantizer_config(const nlohmann::json& config);

/** The JSON value of a flag's text for `opt` ("512", "0.25", "true",
 * "8,5,5,5"); throws std::invalid_argument naming the flag. */
nlohmann::json parse_option_value(const QuantizerOption& opt, const std::string& text);

}  // namespace quanta::train
