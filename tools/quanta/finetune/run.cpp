// What quanta finetune's two kinds of run share: their defaults, and the
// start of a run (the --out policy of run_start.h, the device, the threads
// and the process group).
#include "run.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>

#include "commands.h"
#include "dist/env.h"
#include "engine/cpu/parallel.h"
#include "quant/nf4/nf4_modules.h"
#include "run_start.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/limits.h"
#include "train/outputs.h"

namespace quanta::cli {
namespace {

// A --resume (or a restart's) checkpoint must be of this kind of run and
// keep the settings it was made with.
void check_resume(const FinetuneOptions& o, const RunSpec& spec) {
  try {
    const train::Checkpoint ck = train::load_checkpoint(
        train::out_file(o.out, train::kCheckpointFile), spec.checkpoint_format);
    const nlohmann::json& now = spec.config;
    std::string diff = train::resume_conflict(ck.info.config, now);
    if (diff.empty() && ck.info.config.value("base", "") != now["base"].get<std::string>())
      diff = "base: checkpoint " + ck.info.config.value("base", "") + ", now " +
             now["base"].get<std::string>();
    if (!diff.empty())
      throw std::invalid_argument("--resume cannot change the run it continues (" + diff + ")");
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

}  // namespace

std::optional<StartedRun> start_finetune_run(const FinetuneOptions& o, const RunSpec& spec) {
  RunStart start({.out = o.out,
                  .resume = o.resume,
                  .overwrite = o.overwrite,
                  .files = spec.files,
                  .inputs = spec.inputs,
                  .verb = "fine-tune",
                  .gerund = "fine-tuning",
                  // --steps 0 (a language model's one epoch) is counted once the data
                  // is read; its checkpoint records that count.
                  .complete =
                      [&](int64_t step, int64_t, const nlohmann::json& config) {
                        int64_t steps = o.steps > 0 ? o.steps : config.value("steps", int64_t{0});
                        if (o.epochs > 0 && config.contains("steps_per_epoch"))
                          steps =
                              steps_of_epochs(o.epochs, config["steps_per_epoch"].get<int64_t>());
                        return steps > 0 && step >= steps;
                      },
                  .done_marker = spec.done_marker});
  if (start.resume()) check_resume(o, spec);
  if (start.finished()) return std::nullopt;
  StartedRun run;
  run.resume = start.resume();
  run.folder = start.take(o.nproc, o.dist_timeout);
  run.device = device_flag(o.device);
  if (o.threads > 0) set_num_threads(static_cast<int>(o.threads));
  if (spec.check_inputs) spec.check_inputs();
  run.group = dist::init();
  return run;
}

std::string with_commas(uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

int64_t steps_of_epochs(double epochs, int64_t steps_per_epoch) {
  const double steps = std::ceil(epochs * double(steps_per_epoch));
  if (steps > double(train::kMaxSteps))
    throw UsageError("--epochs of " + std::to_string(steps_per_epoch) +
                     " steps each make more than " + std::to_string(train::kMaxSteps) + " steps");
  return std::max<int64_t>(1, int64_t(steps));
}

void resolve_defaults(FinetuneOptions& o, const std::function<bool(const char*)>& given) {
  const bool lm = !o.model.empty();
  if (lm && !o.checkpoint.empty())
    throw UsageError("give a classifier CHECKPOINT or --model DIR (a language model), not both");
  if (!lm && o.checkpoint.empty())
    throw UsageError(
        "give a classifier CHECKPOINT, or --model DIR and --data FILE for a "
        "language model");
  static const std::vector<const char*> kLmOnly = {"--eval-data",
                                                   "--merge-to",
                                                   "--max-shard-size",
                                                   "--seq-len",
                                                   "--grad-accum",
                                                   "--warmup-steps",
                                                   "--eval-every",
                                                   "--weight-decay",
                                                   "--max-grad-norm",
                                                   "--lr-schedule",
                                                   "--target-modules",
                                                   "--compute-dtype",
                                                   "--use-rslora",
                                                   "--use-dora",
                                                   "--init-lora-weights",
                                                   "--pack",
                                                   "--document-start",
                                                   "--document-end",
                                                   "--train-on-completions-only",
                                                   "--assistant-only-loss",
                                                   "--chat-template-path",
                                                   "--recompute",
                                                   "--shard",
                                                   "--no-graph",
                                                   "--target-modules-regex",
                                                   "--exclude-modules",
                                                   "--exclude-modules-regex",
                                                   "--layers-to-transform",
                                                   "--layers-pattern",
                                                   "--rank-pattern",
                                                   "--alpha-pattern",
                                                   "--modules-to-save",
                                                   "--bias",
                                                   "--lora-bias",
                                                   "--trainable-token-indices",
                                                   "--adapters",
                                                   "--adapters-any-base",
                                                   "--epochs",
                                                   "--warmup-ratio",
                                                   "--adam-beta1",
                                                   "--adam-beta2",
                                                   "--adam-epsilon",
                                                   "--neftune-noise-alpha"};
  static const std::vector<const char*> kClassifierOnly = {"--limit-train", "--limit-test",
                                                           "--merge"};
  std::vector<const char*> not_taken = lm ? kClassifierOnly : kLmOnly;
  if (!lm) {
    not_taken.insert(not_taken.end(), std::begin(kEvaFlagNames), std::end(kEvaFlagNames));
    not_taken.insert(not_taken.end(), std::begin(kCordaFlagNames), std::end(kCordaFlagNames));
  }
  for (const char* flag : not_taken)
    if (given(flag))
      throw UsageError(std::string(flag) +
                       (lm ? " is for the classifier of quanta train, not --model"
                           : " is for a language model (--model DIR)"));
  // Two ways to give one setting.
  const char* const kPeftField = " (PEFT's field is a list of names or one regular expression)";
  for (const auto& [a, b, why] :
       {std::tuple{"--target-modules", "--target-modules-regex", kPeftField},
        {"--exclude-modules", "--exclude-modules-regex", kPeftField},
        {"--steps", "--epochs", ""},
        {"--warmup-steps", "--warmup-ratio", ""}})
    if (given(a) && given(b))
      throw UsageError(std::string("give ") + a + " or " + b + ", not both" + why);
  refuse_any_base_alone(o.adapters);
  // EVA's settings shape nothing else.
  for (const char* flag : kEvaFlagNames)
    if (given(flag) && o.init_lora_weights != "eva")
      throw UsageError(std::string(flag) + " is a setting of --init-lora-weights eva");
  for (const char* flag : kCordaFlagNames)
    if (given(flag) && o.init_lora_weights != "corda")
      throw UsageError(std::string(flag) + " is a setting of --init-lora-weights corda");
  // A folder's adapters are trained as its adapter_config.json describes
  // them; only their dropout, a training setting, may change.
  static const std::vector<const char*> kAdapterShape = {"--lora-r",
                                                         "--lora-alpha",
                                                         "--target-modules",
                                                         "--target-modules-regex",
                                                         "--exclude-modules",
                                                         "--exclude-modules-regex",
                                                         "--layers-to-transform",
                                                         "--layers-pattern",
                                                         "--rank-pattern",
                                                         "--alpha-pattern",
                                                         "--modules-to-save",
                                                         "--bias",
                                                         "--lora-bias",
                                                         "--trainable-token-indices",
                                                         "--use-rslora",
                                                         "--use-dora",
                                                         "--init-lora-weights"};
  if (given("--adapters"))
    for (const char* flag : kAdapterShape)
      if (given(flag))
        throw UsageError(std::string(flag) +
                         " shapes new adapters, and --adapters DIR trains the folder's as its "
                         "adapter_config.json describes them: give one or the other");
  // The classifier's defaults are the library's LoRA ones; a language
  // model's are QLoRA's usual recipe.
  if (o.steps < 0) o.steps = lm ? 0 : 300;  // 0: one epoch, known once the data is read
  if (o.batch_size < 0) o.batch_size = lm ? 4 : 128;
  if (o.lr < 0) o.lr = lm ? 2e-4 : 1e-3;
  // With --adapters, the folder's (run_lm_finetune reads it).
  if (o.lora_dropout < 0 && !given("--adapters"))
    o.lora_dropout = lm ? 0.05 : quant::LoRAOptions{}.dropout;
  if (o.log_every < 0) o.log_every = lm ? 10 : 50;
}

}  // namespace quanta::cli
