#pragma once
// --no-graph of quanta train and quanta finetune --model: on cuda and sim the
// training loop captures its step as one graph and replays it
// (train/captured_step.h); the flag launches every kernel as it is called
// instead. The results are the same either way.
#include <CLI/CLI.hpp>
#include <string>

namespace quanta::cli {

/** Adds --no-graph to `sub`, stored in `no_graph`; `prefix` starts its help
 * text (finetune's "--model: "). */
CLI::Option* add_no_graph_flag(CLI::App& sub, bool& no_graph, const std::string& prefix = "");

}  // namespace quanta::cli
