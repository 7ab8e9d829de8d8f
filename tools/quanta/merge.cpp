// `quanta merge --model DIR --adapters DIR --out DIR`: a PEFT adapter folder
// merged into its base and written as a float Hugging Face folder: each
// weight the NF4 base dequantized plus the adapters' change (PEFT's merge
// over a bitsandbytes model computes the same sum, then quantizes it to 4
// bits again), for adapters trained without --merge-to (or elsewhere). A layer at a time: the
// base's float weights are read as each layer is quantized, and the merged
// weights made as each is written, so neither the device nor the host ever
// holds the float model.
#include <chrono>
#include <cstdio>
#include <memory>

#include "adapter_flags.h"
#include "commands.h"
#include "finetune/run.h"
#include "flag_checks.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/qlora_model.h"
#include "merged_folder.h"
#include "peak_memory.h"

namespace quanta::cli {

namespace {

struct MergeFlags {
  std::string model, out, device = "cpu", chat_template_path, max_shard_size, onto = "nf4";
  AdapterFlags adapters;
};

void run_merge(const MergeFlags& f) {
  const llm::SaveOptions save{.max_shard_bytes = max_shard_size_flag(f.max_shard_size)};
  refuse_unmergeable("--out", f.model, f.out);
  const bool onto_float = f.onto == "float";
  if (onto_float && llm::folder_quantization(f.model))
    throw UsageError("--onto float needs the float base folder: " + f.model +
                     " is a 4-bit folder, whose float weights are gone");
  const auto start = std::chrono::steady_clock::now();
  auto model = llm::load_base_model(f.model, device_flag(f.device), std::nullopt,
                                    {.defer_layer_weights = true});
  const llm::QLoRAReport report = apply_adapter_folder(*model, f.adapters, f.model);
  try {
    llm::check_qlora_mergeable(*model);
  } catch (const std::invalid_argument& e) {
    throw UsageError(f.adapters.dir + ": " + e.what());
  }
  const std::string holds =
      write_merged_folder(*model, f.model, f.out, f.chat_template_path, save, onto_float);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t peak = peak_rss_bytes();
  std::printf(
      "merged %zu adapted layers of %s into %s (%zu linear layers%s): %s (%s); %.1f s%s\n",
      llm::lora_layers(*model).size(), f.adapters.dir.c_str(), f.model.c_str(),
      report.layers.size(), onto_float ? "" : " in NF4", f.out.c_str(), holds.c_str(), seconds,
      peak < 0 ? "" : ("; peak resident memory " + with_commas(uint64_t(peak)) + " bytes").c_str());
}

}  // namespace

void add_merge(CLI::App& app) {
  auto f = std::make_shared<MergeFlags>();
  CLI::App* sub = app.add_subcommand(
      "merge",
      "A PEFT LoRA adapter folder merged into its base model folder and written as a float "
      "Hugging Face folder, a layer at a time");
  sub->footer(
      "The base is quantized to NF4 as the adapters' folder records (as they were trained "
      "over it), each merged weight is that base dequantized plus the adapters' change "
      "(DoRA's, lora_bias and trained biases and token rows included), in the model's dtype. "
      "Neither the device nor the host holds the float model at once.\n\n"
      "Examples:\n"
      "  quanta merge --model tests/data/llm/models/llama_gqa --adapters runs/lm/adapters --out "
      "runs/lm-merged\n"
      "  quanta merge --model DIR --adapters RUN/adapters --out MERGED --device cuda");
  sub->add_option("--model", f->model,
                  "the base model folder: config.json and safetensors "
                  "weights, float or transformers' 4-bit")
      ->required();
  add_adapter_flags(*sub, f->adapters);
  sub->get_option("--adapters")->required();
  sub->add_option("--out", f->out,
                  "the folder to write: config.json, model.safetensors, the base's tokenizer "
                  "files (created if needed; its config and weights replaced)")
      ->required();
  add_device_flag(*sub, f->device, "the model and the merge");
  add_max_shard_size_flag(*sub, f->max_shard_size, "the merged weights");
  sub->add_option("--onto", f->onto,
                  "nf4: each weight the NF4 base dequantized plus the adapters' change, the model "
                  "the adapters were trained in (the sum PEFT's merge over a bitsandbytes model "
                  "forms before quantizing it again); float: "
                  "the float base folder's weights plus the change (PEFT's merge over the float "
                  "model; not for adapters fitted to the quantization error, LoftQ's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"nf4", "float"}));
  sub->add_option("--chat-template-path", f->chat_template_path,
                  "a chat template written into the folder instead of the base's (as TRL saves "
                  "a run's chat_template_path with the model): a .jinja file, or a model "
                  "folder's templates");
  sub->callback([f] { run_merge(*f); });
}

}  // namespace quanta::cli
