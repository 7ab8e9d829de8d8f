#include "merged_folder.h"

#include <filesystem>

#include "commands.h"
#include "flag_checks.h"
#include "llm/model/config.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/qlora_model.h"
#include "llm/text/chat_template.h"

namespace quanta::cli {

namespace fs = std::filesystem;

void refuse_unmergeable(const std::string& flag, const std::string& model_dir,
                        const std::string& out) {
  refuse_output_over_input(
      flag, (fs::path(out) / "model.safetensors").string(),
      {{"the base model", (fs::path(model_dir) / "model.safetensors").string()}});
  // A sharded base is read a layer at a time while the merge is written:
  // its own folder would lose the shards it still reads.
  std::error_code ec;
  if (fs::equivalent(out, model_dir, ec))
    throw UsageError(flag + " " + out + " is the base model's folder " + model_dir +
                     ", which the merge reads while writing: give another folder");
  const llm::DecoderConfig config =
      llm::read_decoder_config((fs::path(model_dir) / "config.json").string());
  // A 4-bit image-text folder made without skipping its vision tower
  // (load_in_4bit's default) stores it quantized.
  if (config.image_text_config.empty() || !llm::folder_quantization(model_dir)) return;
  for (const auto& [name, t] : llm::read_non_decoder_weights(config, model_dir))
    if (name.find(".quant_state.") != std::string::npos || name.ends_with(".absmax"))
      throw UsageError(flag +
                       " over a 4-bit image-text folder whose vision tower is stored "
                       "quantized (" +
                       name +
                       "), which a merged float folder cannot carry (merge over the float base "
                       "folder, or one quanta quantize wrote)");
}

std::string write_merged_folder(llm::CausalLM& model, const std::string& model_dir,
                                const std::string& out, const std::string& chat_template_path,
                                const llm::SaveOptions& options, bool onto_float) {
  // An image-text model's vision tower goes with it as the base stores it.
  llm::save_merged_causal_lm(model, out, llm::read_non_decoder_weights(model.config(), model_dir),
                             options,
                             onto_float ? llm::decoder_weight_reader(model_dir)
                                        : std::function<Tensor(const std::string&)>());
  llm::copy_tokenizer_files(model_dir, out);
  if (!chat_template_path.empty())
    llm::ChatTemplate::from_folder(model_dir, "", chat_template_path).save(out);
  return std::string(llm::torch_dtype_name(model.config().dtype)) +
         (onto_float ? ", the float base plus the adapters"
                     : ", the NF4 base dequantized plus the adapters") +
         "; the base's tokenizer files" +
         (chat_template_path.empty() ? "" : ", the chat template of --chat-template-path");
}

}  // namespace quanta::cli
