#pragma once
// finetune --init-lora-weights corda's settings: PEFT's CordaConfig's
// corda_method and the samples of --data the covariances come from, as
// --corda-* flags.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "llm/data/lm_examples.h"
#include "llm/qlora/corda_init.h"
#include "llm/qlora/lora_config.h"

namespace quanta::cli {

struct CordaFlags {
  std::string method = "ipm";
  int64_t samples = 256;  // 0: every example of --data
  std::string covariance_file;
};

/** The flags' names, for the checks that refuse them without corda. */
inline constexpr const char* kCordaFlagNames[] = {"--corda-method", "--corda-samples",
                                                  "--corda-covariance-file"};

/** Adds the --corda-* flags to `sub`. */
void add_corda_flags(CLI::App& sub, CordaFlags& flags);

/** The flags as PEFT's CordaConfig (what adapter_config.json records). */
llm::CordaConfig corda_config(const CordaFlags& flags);

/** The flags as a checkpoint's config keeps them (a resume computes the
 * same start). */
nlohmann::json corda_flags_json(const CordaFlags& flags);

/** CorDA's samples: the first flags.samples examples of `examples` (--data)
 * in file order, with progress on `log` every 64, or the covariance file
 * where it exists (written by the `lead` rank where not); `examples` and
 * `log` must outlive it. Says on `log` what it reads. */
llm::CordaData corda_data(const llm::LmExamples& examples, const CordaFlags& flags,
                          const std::string& data_path, bool lead, std::ostream& log);

}  // namespace quanta::cli
