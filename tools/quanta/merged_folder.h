#pragma once
// A fine-tuned language model merged into a Hugging Face folder: what
// `quanta finetune --merge-to` and `quanta merge` write, and what they
// refuse before any work is done.
#include <string>

#include "llm/model/causal_lm.h"
#include "llm/model/model_folder.h"

namespace quanta::cli {

/** Refuses, as a UsageError naming `flag`, a merge into `out` that would
 * overwrite the base folder `model_dir`'s weights, or that cannot be written:
 * a 4-bit image-text folder whose vision tower is stored quantized (a merged
 * float folder cannot carry it). Cheap: reads configs and headers only. */
void refuse_unmergeable(const std::string& flag, const std::string& model_dir,
                        const std::string& out);

/** Writes `model` (converted and adapted) merged into folder `out`, a layer
 * at a time (llm::save_merged_causal_lm: the float model is never whole on
 * the device or the host; sharded as `options` says), with the vision tower
 * of an image-text base, the base's tokenizer files and, given, the chat
 * template of `chat_template_path` (as TRL saves a run's with the model).
 * `onto_float`: over the float weights of `model_dir` (a float folder)
 * instead of the NF4 base, PEFT's merge over the float model
 * (save_merged_causal_lm's float_base). Returns what the folder holds, for
 * the command's last line. */
std::string write_merged_folder(llm::CausalLM& model, const std::string& model_dir,
                                const std::string& out, const std::string& chat_template_path = "",
                                const llm::SaveOptions& options = {}, bool onto_float = false);

}  // namespace quanta::cli
