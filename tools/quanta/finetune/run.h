#pragma once
// What `quanta finetune`'s two kinds of run share: the flags (the classifier
// of quanta train, or a language model with --model) and the start of a run
// (the --out folder's plan and lock, the launcher's restarts, --nproc,
// the process group). classifier.cpp runs the classifier, language_model.cpp
// the language model; ../finetune.cpp is the command.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "adapter_flags.h"
#include "corda_flags.h"
#include "dist/process_group.h"
#include "document_flags.h"
#include "engine/device.h"
#include "eva_flags.h"
#include "flag_checks.h"
#include "profile_flag.h"
#include "train/run_folder.h"

namespace quanta::cli {

/** Every flag of quanta finetune. Flags whose default differs between the
 * two kinds hold a negative value until resolve_defaults(). */
struct FinetuneOptions {
  // Either a classifier checkpoint, or a language-model folder.
  std::string checkpoint, model;
  std::string out, data;
  int64_t lora_r = 8;
  double lora_alpha = 16, lora_dropout = -1;
  int64_t steps = -1, batch_size = -1;
  double lr = -1;
  uint64_t seed = 0;
  int64_t log_every = -1, threads = 0, nproc = 1;
  std::string device = "cpu";     // a resume may change it
  std::string precision = "f32";  // or "bf16": MixedPrecision's products
  std::string dist_timeout;       // seconds; empty: the library's default
  bool overwrite = false, resume = false;
  // The classifier's.
  int64_t limit_train = -1, limit_test = -1;
  bool merge = false;
  // The language model's.
  std::string eval_data, merge_to, max_shard_size;
  int64_t seq_len = 0, grad_accum = 1, warmup_steps = 0, eval_every = 0;
  double weight_decay = 0, max_grad_norm = 1.0;
  // transformers' TrainingArguments: num_train_epochs and warmup_ratio (0:
  // not given; --steps and --warmup-steps then), AdamW's betas and epsilon.
  double epochs = 0, warmup_ratio = 0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double neftune_noise_alpha = 0;  // NEFTune's noise on the embeddings (0: none)
  std::string lr_schedule = "linear", target_modules = "all-linear", compute_dtype = "auto";
  // PEFT's layer choice: as written on the command line (parsed into
  // LoraSettings by run_lm_finetune); the patterns PATTERN=VALUE, in order.
  std::string target_modules_regex, exclude_modules, exclude_modules_regex;
  std::string layers_to_transform, layers_pattern, modules_to_save;
  std::vector<std::string> rank_pattern, alpha_pattern, trainable_token_indices;
  std::string bias = "none";
  std::string init_lora_weights = "true";  // PEFT's values: true, gaussian, false, loftq
  EvaFlags eva;                            // --init-lora-weights eva's settings
  CordaFlags corda;                        // --init-lora-weights corda's settings
  bool use_rslora = false, use_dora = false, lora_bias = false, pack = false,
       completions_only = false, assistant_only = false, recompute = false, shard = false;
  bool no_graph = false;
  ProfileFlags profile;            // steps whose kernel calls are counted and timed
  AdapterFlags adapters;           // train on from a PEFT folder's adapters
  std::string chat_template_path;  // conversations through this template
  DocumentFlags documents;         // token files and text: where documents meet
};

/** --epochs as steps: ceil(epochs x steps_per_epoch), at least 1 (as
 * transformers' Trainer counts num_train_epochs); a UsageError past
 * train::kMaxSteps. */
int64_t steps_of_epochs(double epochs, int64_t steps_per_epoch);

/** Fills the kind-specific defaults (lr, steps, batch size, dropout, log
 * cadence) and refuses, as a UsageError naming it, a flag the kind does
 * not take. `given` says which flags were on the command line. */
void resolve_defaults(FinetuneOptions& o, const std::function<bool(const char*)>& given);

/** What a kind of run writes and defines. */
struct RunSpec {
  /** The files (and folders) a run writes in --out. */
  std::vector<std::string> files;
  /** The config a checkpoint keeps; a --resume must not change it. */
  nlohmann::json config;
  /** Inputs that no output may overwrite. */
  std::vector<InputFile> inputs;
  /** The output that exists once a run completed. */
  std::string done_marker;
  /** The checkpoint format tag. */
  std::string checkpoint_format;
  /** Checks the inputs exist, once --out is taken and before the ranks
   * form their group (may be empty). */
  std::function<void()> check_inputs;
};

/** A started run: whether it resumes, the --out lock (rank 0), the group. */
struct StartedRun {
  bool resume = false;
  train::RunFolderLock folder;
  std::shared_ptr<dist::ProcessGroup> group;
  Device device = Device::cpu();
};

/** Plans --out (refusing a folder that holds a run, unless --resume or
 * --overwrite; continuing a launcher's restart), re-runs under quanta launch
 * for --nproc, takes the folder and forms the process group. nullopt when a
 * restart found the run complete. */
std::optional<StartedRun> start_finetune_run(const FinetuneOptions& o, const RunSpec& spec);

/** "1,234,567": the byte and parameter counts finetune prints. */
std::string with_commas(uint64_t v);

/** The language-model flags of quanta finetune. */
void add_lm_finetune_flags(CLI::App& sub, FinetuneOptions& o);

/** quanta finetune --model DIR --data FILE --out DIR (language_model.cpp). */
void run_lm_finetune(const FinetuneOptions& o);

/** quanta finetune CHECKPOINT --out DIR: the classifier of quanta train
 * (classifier.cpp). */
void run_classifier_finetune(const FinetuneOptions& o);

}  // namespace quanta::cli
