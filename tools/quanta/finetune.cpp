// `quanta finetune`: its flags, and which kind of run they ask for: a
// language model (--model DIR, finetune/language_model.cpp) or the
// classifier of quanta train (finetune/classifier.cpp).
#include <CLI/CLI.hpp>
#include <memory>

#include "commands.h"
#include "dist_timeout.h"
#include "finetune/run.h"
#include "flag_checks.h"
#include "precision_flag.h"
#include "profile_flag.h"
#include "train/limits.h"

namespace quanta::cli {

void add_finetune(CLI::App& app) {
  auto o = std::make_shared<FinetuneOptions>();
  CLI::App* sub = app.add_subcommand(
      "finetune",
      "QLoRA: LoRA adapters trained over a frozen NF4 base, of a language model (--model DIR, "
      "a Hugging Face folder; PEFT adapters out) or of the classifier of quanta train --task "
      "classify");
  sub->footer(
      "Examples:\n"
      "  quanta finetune --model tests/data/llm/models/llama_gqa --data tokens.bin --seq-len 64 "
      "--out runs/lm\n"
      "  quanta finetune --model DIR --data train.jsonl --eval-data eval.jsonl --seq-len 512 \\\n"
      "      --lora-r 16 --target-modules q_proj,v_proj --out runs/lm --merge-to runs/merged\n"
      "  quanta train --task classify --out runs/clf\n"
      "  quanta quantize runs/clf/checkpoint.safetensors runs/clf/nf4.safetensors\n"
      "  quanta finetune runs/clf/nf4.safetensors --out runs/qlora --steps 300\n"
      "  quanta finetune runs/clf/checkpoint.safetensors --out runs/qlora --merge\n"
      "  quanta finetune runs/clf/checkpoint.safetensors --out runs/qlora2 --nproc 2\n"
      "A language model's linear layers but lm_head are quantized to NF4 as bitsandbytes does\n"
      "(block 64, double quant); --out gets adapters/ (a PEFT folder), checkpoint.safetensors\n"
      "and metrics.jsonl. See docs/finetune.md.");
  sub->add_option("checkpoint", o->checkpoint,
                  "classifier checkpoint (float, or NF4 from quanta quantize)");
  sub->add_option(
      "--model", o->model,
      "a language model: Hugging Face decoder folder (the model types docs/llm.md lists: Llama, "
      "Mistral, Qwen, Gemma, Phi-3, OLMo, SmolLM3, Granite, ...)");
  sub->add_option("--out", o->out, "output folder")->required();
  sub->add_option("--lora-r", o->lora_r, "LoRA rank r (PEFT's r)")
      ->capture_default_str()
      ->transform(integer_in(1, 4096));
  sub->add_option("--lora-alpha", o->lora_alpha,
                  "LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with "
                  "--use-rslora)")
      ->capture_default_str()
      ->check(number_in(0, 1e6, true));
  sub->add_option("--lora-dropout", o->lora_dropout,
                  "dropout on the adapters' input (0.05 with --model)")
      ->default_str("0")
      ->check(number_in(0.0, 0.999));
  sub->add_option("--steps", o->steps, "optimizer steps (with --model: one epoch of --data)")
      ->default_str("300")
      ->transform(integer_in(1, train::kMaxSteps));
  sub->add_option("--batch-size", o->batch_size,
                  "global batch, split across ranks: images, or sequences with --model (4)")
      ->default_str("128")
      ->transform(integer_in(1, train::kMaxBatchSize));
  sub->add_option("--lr", o->lr, "peak learning rate of the adapters (2e-4 with --model)")
      ->default_str("0.001")
      ->check(number_in(0, 1e6, true));
  sub->add_option("--seed", o->seed, "seed of the adapters' init, dropout and data order")
      ->capture_default_str()
      ->transform(unsigned_integer());
  sub->add_option("--data", o->data,
                  "training data: a Fashion-MNIST folder (default: the checkpoint's), or with "
                  "--model an llm.c token file, a JSONL file of input_ids (and labels), or "
                  "a .txt read with the folder's tokenizer.model");
  sub->add_option("--limit-train", o->limit_train, "use only the first N training images")
      ->transform(integer_in(0, train::kMaxCount));
  sub->add_option("--limit-test", o->limit_test, "evaluate on only the first N test images")
      ->transform(integer_in(1, train::kMaxCount));
  sub->add_option("--log-every", o->log_every, "steps between log lines (10 with --model)")
      ->default_str("50")
      ->transform(integer_in(1, train::kMaxCount));
  sub->add_option("--threads", o->threads, "CPU threads per rank")
      ->capture_default_str()
      ->transform(thread_count());
  add_device_flag(*sub, o->device, "the model, the adapters and the batches");
  sub->add_option("--nproc", o->nproc, "local ranks, data-parallel (runs quanta launch -n N)")
      ->capture_default_str()
      ->transform(integer_in(1, train::kMaxRanks));
  add_dist_timeout_flag(*sub, o->dist_timeout);
  add_precision_flag(*sub, o->precision,
                     "the f32 layers' (LoRA's, an f32 lm_head, the classifier's; NF4 "
                     "layers follow --compute-dtype)");
  sub->add_flag("--resume", o->resume,
                "continue the fine-tuning in --out from its checkpoint (--steps may grow; the "
                "rest must stay)");
  sub->add_flag("--overwrite", o->overwrite,
                "replace the run --out already holds (checkpoint, metrics, adapters, merged "
                "model) instead of refusing");
  sub->add_flag("--merge", o->merge,
                "also write merged.safetensors, the float model with the "
                "adapters merged in");
  add_profile_flags(*sub, o->profile);
  add_lm_finetune_flags(*sub, *o);
  sub->callback([o, sub] {
    resolve_defaults(*o, [sub](const char* flag) { return sub->count(flag) > 0; });
    if (o->model.empty())
      run_classifier_finetune(*o);
    else
      run_lm_finetune(*o);
  });
}

}  // namespace quanta::cli
