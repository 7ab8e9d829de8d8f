#pragma once
// --precision of the commands that run a model (finetune, eval, generate;
// train keeps it in its config): f32, or bf16 for MixedPrecision's products
// (engine/precision.h).
#include <CLI/CLI.hpp>
#include <string>

namespace quanta::cli {

/** Adds --precision f32|bf16 to `sub`, stored in `precision` (default f32);
 * `what` names the products it changes ("the model's"). */
CLI::Option* add_precision_flag(CLI::App& sub, std::string& precision, const std::string& what);

}  // namespace quanta::cli
