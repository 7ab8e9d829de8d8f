#pragma once
// Range checks for the numeric flags of every subcommand, one place for all.
// CLI11 alone clamps an integer beyond int64 to its limit (strtoll), reads
// "010" as octal, takes "-1" for an unsigned flag as 2^64 - 1, and lets
// "inf" and "nan" through its number checks; these validators read the text
// themselves and refuse all of that with a message naming the allowed range.
// The integer ones also rewrite the text in plain decimal, so attach them
// with ->transform(): ->check() hands a validator a copy of the text.
// And --device, the same flag for every subcommand that runs a model, and
// the rule that no command writes over one of its inputs.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/device.h"
#include "engine/dtype.h"

namespace quanta::cli {

/** A decimal integer in [lo, hi]. */
CLI::Validator integer_in(int64_t lo, int64_t hi);

/** A decimal integer in [0, 2^64 - 1] (seeds). */
CLI::Validator unsigned_integer();

/** A finite number in [lo, hi]; the bounds left out when `above_lo` (lo,
 * hi] or `below_hi` [lo, hi). */
CLI::Validator number_in(double lo, double hi, bool above_lo = false, bool below_hi = false);

/** --threads: 0 (all cores) up to train::max_threads(). */
CLI::Validator thread_count();

/** --device's help: where `what` live. */
std::string device_flag_help(const std::string& what);
/** Adds --device (cpu, cuda, cuda:N, sim, sim:N; default cpu) to `sub`:
 * `what` lives there. */
CLI::Option* add_device_flag(CLI::App& sub, std::string& device, const std::string& what);
/** The device --device names (train::run_device); its errors are usage
 * errors (exit 2). */
Device device_flag(const std::string& device);

/** --compute-dtype: the dtype NF4 weights are dequantized to
 * (bnb_4bit_compute_dtype): bfloat16, float32, float16, or "auto", the
 * model's dtype (f32 for an f64 model). bitsandbytes computes an f32 or
 * bf16 layer in its input's dtype whatever bnb_4bit_compute_dtype says
 * (Linear4bit.set_compute_type), so "auto" is what PEFT + bitsandbytes
 * compute in. Anything else is a UsageError naming it. */
DType compute_dtype_flag(const std::string& name, DType model_dtype);

/** Adds --max-shard-size to `sub` (transformers' max_shard_size: past it
 * `what` is written in shards with an index; default 50GB, save_pretrained's). */
CLI::Option* add_max_shard_size_flag(CLI::App& sub, std::string& size, const std::string& what);
/** --max-shard-size as bytes (llm::parse_shard_size), empty: the default;
 * a UsageError naming the flag otherwise. */
uint64_t max_shard_size_flag(const std::string& size);

/** A file a command reads: what it is ("the checkpoint") and its path. */
struct InputFile {
  std::string what;
  std::string path;
};
/** Throws UsageError (exit 2) when `output` (written by flag `flag`) is one
 * of `inputs`: the same file, through a symlink or a hard link too (the
 * same inode). Writing it would destroy the input the command is reading. */
void refuse_output_over_input(const std::string& flag, const std::string& output,
                              const std::vector<InputFile>& inputs);

}  // namespace quanta::cli
