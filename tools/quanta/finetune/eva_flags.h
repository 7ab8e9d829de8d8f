#pragma once
// finetune --init-lora-weights eva's settings: PEFT's EvaConfig as --eva-*
// flags, the batches EVA reads from --data, and the line that says what
// it did.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "llm/data/lm_examples.h"
#include "llm/qlora/eva_init.h"
#include "llm/qlora/lora_config.h"

namespace quanta::cli {

struct EvaFlags {
  double rho = 2, tau = 0.99;
  bool use_label_mask = true, whiten = false, adjust_scaling_factors = true;
  int64_t batch_size = 0;  // 0: --batch-size
  int64_t max_forwards = 1000;
};

/** The flags' names, for the checks that refuse them without eva. */
inline constexpr const char* kEvaFlagNames[] = {"--eva-rho",
                                                "--eva-tau",
                                                "--eva-use-label-mask",
                                                "--eva-whiten",
                                                "--eva-adjust-scaling-factors",
                                                "--eva-batch-size",
                                                "--eva-max-forwards"};

/** Adds the --eva-* flags to `sub`. */
void add_eva_flags(CLI::App& sub, EvaFlags& flags);

/** The flags as PEFT's EvaConfig (what adapter_config.json records). */
llm::EvaConfig eva_config(const EvaFlags& flags);

/** The flags as a checkpoint's config keeps them (a resume computes the
 * same start). */
nlohmann::json eva_flags_json(const EvaFlags& flags);

/** EVA's batches: `examples` (--data) in file order, flags.batch_size rows
 * each (0: `batch_size`), sketches from `seed`, with progress on `log`
 * every ten passes; `examples` and `log` must outlive it. Says on `log`
 * what it reads. */
llm::EvaData eva_data(const llm::LmExamples& examples, const EvaFlags& flags, int64_t batch_size,
                      uint64_t seed, const std::string& data_path, std::ostream& log);

/** What EVA's start did, in one line. */
std::string eva_summary(const llm::EvaStarts& starts, const llm::LoraSettings& lora,
                        double seconds);

}  // namespace quanta::cli
