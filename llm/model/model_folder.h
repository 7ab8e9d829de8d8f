#pragma once
// Hugging Face model folders: config.json with model.safetensors, or shards
// model-0000N-of-0000M.safetensors listed by model.safetensors.index.json,
// as save_pretrained writes them.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/io/safetensors.h"
#include "engine/nn/module.h"
#include "llm/model/causal_lm.h"

namespace quanta::llm {

/** The path of file `name` of model folder `dir`, checked before anything
 * opens it: a directory, FIFO or device there, a broken symlink, or a
 * symlink leading out of the folder is refused (std::runtime_error naming
 * the file). Symlinks inside the folder, and those of the Hugging Face hub
 * cache (snapshots/REV/FILE to blobs/ beside snapshots/), are followed. An
 * absent file gives its path: the caller says what it needed. */
std::string model_folder_file(const std::string& dir, const std::string& name);

/** The weight files of model folder `dir`: its model.safetensors, or the
 * shards its model.safetensors.index.json lists (in name order), each
 * checked as model_folder_file checks it and present. Throws
 * std::runtime_error naming the folder or index otherwise. */
std::vector<std::string> model_weight_files(const std::string& dir);

/** The tensors of a model folder's weights (those `keep` accepts), each
 * read from its file only when asked for: what lets a loader convert a
 * model a layer at a time without holding the whole of it. The folder is
 * checked when this is made, as read_model_weights checks it (headers and
 * index; no tensor's bytes are read). */
class ModelWeightFiles {
 public:
  explicit ModelWeightFiles(const std::string& dir,
                            const std::function<bool(const std::string&)>& keep = {});
  /** The names, in the order read_model_weights gives them. */
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const;
  /** As stored (read gives this dtype and shape). Throw for another name. */
  DType dtype(const std::string& name) const;
  const Shape& shape(const std::string& name) const;
  /** One tensor, on the host, read from its file now. */
  Tensor read(const std::string& name) const;

 private:
  const io::SafetensorsReader& file_of(const std::string& name) const;
  std::vector<std::shared_ptr<io::SafetensorsReader>> files_;
  std::map<std::string, std::size_t> where_;  // name -> its file in files_
  std::vector<std::string> names_;
};

/** Every tensor of the folder's weights, by name (f32, bf16 and f16 as
 * stored), or those whose name `keep` accepts. A sharded folder is read
 * through its index: a name the index lists that its shard lacks, a name a
 * shard holds that the index does not list, or a shard the index names
 * that is missing is an error naming the file. Shards are read one at a
 * time; one holding nothing `keep` accepts is not read. */
StateDict read_model_weights(const std::string& dir,
                             const std::function<bool(const std::string&)>& keep = {});

/** How load_causal_lm reads a folder. */
struct LoadOptions {
  /** Leave the decoder layers' linear weights (the projections every QLoRA
   * conversion quantizes) in their files (CausalLM::defer_weights) for
   * apply_qlora or quantize_base to read one layer at a time as it quantizes
   * it, on the host: the float model is then never whole in memory, on the
   * host or on the device, and peak memory is the 4-bit base, the rest of the
   * model (embeddings, norms, lm_head) and a few float layers. The model runs
   * no forward until they are read. */
  bool defer_layer_weights = false;
};

/** The model of folder `dir` on `device` (weights in the config's dtype),
 * its tensors read one at a time. */
std::shared_ptr<CausalLM> load_causal_lm(const std::string& dir, Device device = Device::cpu(),
                                         const LoadOptions& options = {});

/** The weights of folder `dir`'s decoder by the model's names
 * ("model.layers.0.mlp.up_proj.weight", whatever the folder's layout calls
 * them), each read from its file when asked for, on the host as stored: the
 * float weights a merge over the float model reads a layer at a time. The
 * folder is checked now (its config and headers); a name it does not hold
 * throws std::invalid_argument naming it and the folder. */
std::function<Tensor(const std::string&)> decoder_weight_reader(const std::string& dir);

/** transformers' save_pretrained default max_shard_size (5.x): 50 GB. */
inline constexpr uint64_t kDefaultMaxShardBytes = 50'000'000'000ull;

/** How a model folder's weights are written. */
struct SaveOptions {
  /** The most bytes of weights one file holds (transformers' max_shard_size):
   * more are split, in order, into model-0000N-of-0000M.safetensors listed by
   * model.safetensors.index.json, as save_pretrained splits them (a file is
   * closed when the next tensor would take it past this; a tensor larger than
   * this has a file of its own). */
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
};

/** transformers' max_shard_size as bytes: a number with a unit of KB, MB, GB
 * or TB (powers of 1000, any case; "5GB", "1.5GB") or a whole number of
 * bytes. Throws std::invalid_argument naming `text` otherwise, or for 0. */
uint64_t parse_shard_size(const std::string& text);

/** Writes the weights of model folder `dir` (which exists): `weights` under
 * their stored names, in the order to shard them, each made when written
 * (io::save_safetensors_streamed), in one model.safetensors or in shards
 * with their index (metadata total_size and total_parameters, the elements
 * written), as `options` says. Everything the names, dtypes and shapes
 * refuse is refused first; then every file is made beside its target
 * before any is put in place, so an error while making a tensor leaves the
 * folder as it was. The files of the other layout left by an earlier save
 * are removed in an order that never lets a reader take old weights for new
 * (a model.safetensors, which loaders take first, and an old index before
 * new shards come in; stale shards after). `op` starts errors. */
void write_model_weights(const std::string& dir, const std::vector<io::TensorSource>& weights,
                         const SaveOptions& options = {}, const char* op = "save_causal_lm");

/** Writes `model` to `dir` (created if needed) as transformers does:
 * config.json (4.x names) and model.safetensors, tied embeddings stored
 * once, an image-text model's decoder in the hub's layout. `beside` (stored
 * names: read_non_decoder_weights of the folder the model came from) is
 * written with it, so that an image-text model's folder keeps its vision
 * tower. An existing config.json and weights are replaced (write_model_weights);
 * a model over options.max_shard_bytes is written in shards. */
void save_causal_lm(const CausalLM& model, const std::string& dir, const StateDict& beside = {},
                    const SaveOptions& options = {});

/** save_causal_lm of a model of `config` whose weights are made one at a
 * time: `weights` under the model's names (its state dict's,
 * "model.layers.0.mlp.up_proj.weight"), each made, copied to the host and
 * written when its turn in the file comes (io::save_safetensors_streamed), so
 * that the host holds one tensor at a time, never the model
 * (save_merged_causal_lm). The same files as save_causal_lm of a model
 * holding those tensors. */
void save_causal_lm_streamed(const DecoderConfig& config, const std::string& dir,
                             const std::vector<io::TensorSource>& weights,
                             const StateDict& beside = {}, const SaveOptions& options = {});

/** Copies the files of folder `from` that go with its weights but are not
 * them (tokenizer.model, tokenizer.json, tokenizer_config.json,
 * special_tokens_map.json, generation_config.json, chat_template.jinja and
 * additional_chat_templates/; those it has) into `to`,
 * replacing them there, and removes from `to` those of them `from` lacks
 * (an output folder reused from another model keeps none of its tokenizer),
 * and the special token ids of its config.json
 * (bos_token_id, eos_token_id, pad_token_id, at the top and in
 * text_config) into `to`'s, which save_causal_lm wrote without them: a
 * folder derived from `from` (merged, quantized) is then whole, and a
 * class default (Phi-3's pad id 32000) never replaces the base's. */
void copy_tokenizer_files(const std::string& from, const std::string& to);

/** The ids folder `dir` names as `key` (bos_token_id, eos_token_id, ...),
 * where transformers' generate finds them: one id or a list, of
 * generation_config.json when the folder has one, else of config.json;
 * empty when that file has none (or null), negative ids left out. A value
 * other than ids is an error naming the file. */
std::vector<int64_t> special_token_ids(const std::string& dir, const std::string& key);

/** The ids that end generation for folder `dir`: its eos_token_id. */
inline std::vector<int64_t> eos_token_ids(const std::string& dir) {
  return special_token_ids(dir, "eos_token_id");
}

}  // namespace quanta::llm
