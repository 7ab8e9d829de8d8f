#include "adapter_flags.h"

#include <iostream>

#include "commands.h"
#include "llm/qlora/peft_folder.h"
#include "llm/qlora/qlora_model.h"

namespace quanta::cli {

void add_adapter_flags(CLI::App& sub, AdapterFlags& flags, const std::string& prefix,
                       const std::string& use) {
  sub.add_option("--adapters", flags.dir,
                 prefix + "a PEFT LoRA adapter folder" + use +
                     "; the base is quantized to NF4 as the adapters were trained over it");
  sub.add_flag("--adapters-any-base", flags.any_base,
               prefix +
                   "use --adapters though their base_model_name_or_path names another folder "
                   "than --model (a renamed copy of the base; their shapes are still checked)");
}

void refuse_any_base_alone(const AdapterFlags& flags) {
  if (flags.any_base && flags.dir.empty())
    throw UsageError("--adapters-any-base goes with --adapters DIR");
}

llm::QLoRAReport apply_adapter_folder(llm::CausalLM& model, const AdapterFlags& flags,
                                      const std::string& model_dir,
                                      const llm::AdapterTraining& training) {
  llm::QLoRAReport report;
  try {
    report = llm::apply_peft_adapters(model, flags.dir, flags.any_base ? "" : model_dir, training);
  } catch (const llm::AdapterBaseMismatch& e) {
    throw llm::AdapterBaseMismatch(std::string(e.what()) +
                                   " (--adapters-any-base uses them anyway, their shapes checked)");
  }
  if (report.vision_tensors_left_out > 0)
    std::cerr << flags.dir << ": " << report.vision_tensors_left_out
              << " adapter tensors of the vision tower left out (quanta reads text, which they "
                 "do not change)\n";
  return report;
}

void apply_adapter_flags(llm::CausalLM& model, const AdapterFlags& flags,
                         const std::string& model_dir) {
  refuse_any_base_alone(flags);
  if (flags.dir.empty()) return;
  apply_adapter_folder(model, flags, model_dir);
  // Inference only: DoRA's rows' norms are taken once, not each token, and
  // trained token rows are written into their weights once, not copied
  // into a whole new vocabulary each token.
  for (const auto& [name, layer] : llm::lora_layers(model)) layer->keep_weight_norm(true);
  model.merge_trainable_tokens();
}

}  // namespace quanta::cli
