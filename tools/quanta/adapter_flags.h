#pragma once
// --adapters DIR and --adapters-any-base of quanta eval, generate and
// finetune: a PEFT adapter folder applied over the --model folder's NF4 base.
#include <CLI/CLI.hpp>
#include <string>

#include "llm/model/causal_lm.h"
#include "llm/qlora/peft_folder.h"

namespace quanta::cli {

struct AdapterFlags {
  std::string dir;        // empty: no adapters
  bool any_base = false;  // use them whatever base_model_name_or_path says
};

/** Adds --adapters and --adapters-any-base to `sub`; `prefix` starts their
 * help texts (eval's "--model: "), and `use` follows "a PEFT LoRA adapter
 * folder" in --adapters' (finetune's " to train on from"). */
void add_adapter_flags(CLI::App& sub, AdapterFlags& flags, const std::string& prefix = "",
                       const std::string& use = "");

/** A UsageError for --adapters-any-base without --adapters. */
void refuse_any_base_alone(const AdapterFlags& flags);

/** apply_peft_adapters of the flags' folder (given) over `model`, loaded
 * from `model_dir`, with `training`'s changes: a folder made for another
 * base is refused unless --adapters-any-base, and the refusal says so. */
llm::QLoRAReport apply_adapter_folder(llm::CausalLM& model, const AdapterFlags& flags,
                                      const std::string& model_dir,
                                      const llm::AdapterTraining& training = {});

/** Applies the flags' folder to `model`, loaded from `model_dir` (nothing
 * when none was given). An adapter folder made for another base is refused
 * unless --adapters-any-base, and the refusal says so. */
void apply_adapter_flags(llm::CausalLM& model, const AdapterFlags& flags,
                         const std::string& model_dir);

}  // namespace quanta::cli
