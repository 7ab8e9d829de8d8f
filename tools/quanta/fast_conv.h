#pragma once
// --fast-conv of quanta train: lets cuDNN choose convolution algorithms whose
// results vary from run to run (engine/cuda/runtime.h's
// set_nondeterministic_conv). Off by default, so that a run repeats bit for
// bit. Ranks started from here (--nproc N) get the flag with the command line.
#include <CLI/CLI.hpp>

namespace quanta::cli {

/** Adds --fast-conv to `sub`, stored in `fast_conv`. */
CLI::Option* add_fast_conv_flag(CLI::App& sub, bool& fast_conv);

/** Applies the flag to this process: where a GPU is visible, cuDNN may then
 * pick nondeterministic algorithms, and one line on stderr says so; without
 * one it changes nothing. */
void apply_fast_conv(bool fast_conv);

}  // namespace quanta::cli
