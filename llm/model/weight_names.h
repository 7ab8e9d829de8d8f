#pragma once
// How the tensors stored in a model folder are named against the modules
// CausalLM builds. A decoder's folder stores them under the module names
// (model.layers.0.self_attn.q_proj.weight). Gemma 3's image-text folders
// store the decoder as transformers' save_pretrained writes it
// (language_model.model.layers.0...., the hub's layout) or as the 5.x module
// tree names it (model.language_model.layers.0....), beside a vision tower
// and projector quanta does not compute with.
#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "engine/nn/module.h"
#include "llm/model/config.h"

namespace quanta::llm {

/** The modules of an image-text model outside its decoder, children of
 * "model" in transformers' 5.x tree: the vision tower and the projector. */
inline constexpr std::array<const char*, 2> kVisionModules = {"vision_tower",
                                                              "multi_modal_projector"};

/** Whether `name` (a tensor's or a module's) lies in one of kVisionModules,
 * with or without the leading "model.". */
bool outside_decoder(std::string_view name);

/** CausalLM's name for the tensor stored as `stored` in a folder of
 * `config`: itself for a decoder's folder; for an image-text model's, the
 * module name of a decoder tensor in either layout, and nullopt for a
 * tensor of the vision tower or the projector (vision_tower.*,
 * multi_modal_projector.*, with or without "model."). */
std::optional<std::string> decoder_weight_name(const DecoderConfig& config,
                                               const std::string& stored);

/** The weights of `stored` that CausalLM takes, under its names (the
 * vision tower's and projector's left out). */
StateDict decoder_weights(const DecoderConfig& config, const StateDict& stored);

/** The name transformers' save_pretrained stores CausalLM's tensor `name`
 * under (the inverse of decoder_weight_name: the hub's
 * language_model.model.* in an image-text model). */
std::string stored_weight_name(const DecoderConfig& config, const std::string& name);

/** The tensors of folder `dir` (of config `config`) that are not the
 * decoder's, under their stored names: an image-text model's vision tower
 * and projector, which a folder derived from it (merged, quantized) carries
 * unchanged; empty for a decoder's folder. Read shard by shard, the
 * decoder's tensors dropped as each is read. */
StateDict read_non_decoder_weights(const DecoderConfig& config, const std::string& dir);

}  // namespace quanta::llm
