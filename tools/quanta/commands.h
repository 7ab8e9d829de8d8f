#pragma once
// The subcommands of the `quanta` command. Each add_* registers one on `app`
// with a callback that runs it; errors surface as exceptions that main turns
// into one line on stderr and an exit code.
#include <CLI/CLI.hpp>
#include <stdexcept>

namespace quanta::cli {

/** A usage problem found after parsing (exit code 2, like a bad flag). */
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** `quanta inspect FILE [--json]`: what a safetensors file holds. */
void add_inspect(CLI::App& app);

/** `quanta bench SUITE [--json] [--repeat N] [--size full|small]`: timings as
 * ratios to their floors. */
void add_bench(CLI::App& app);

/** `quanta parity FILE...`: reference cases run and compared (parity.cpp). */
void add_parity(CLI::App& app);

/** `quanta quantize IN OUT [--format quanta|bnb|torchao]` (quantize.cpp). */
void add_quantize(CLI::App& app);

/** `quanta finetune CHECKPOINT --out DIR [--rank R] [--nproc N] ...`: LoRA
 * on an NF4 base of the classifier (finetune.cpp). */
void add_finetune(CLI::App& app);

/** `quanta merge --model DIR --adapters DIR --out DIR`: a PEFT adapter
 * folder merged into its base, a layer at a time (merge.cpp). */
void add_merge(CLI::App& app);

/** `quanta launch -n N -- PROGRAM ARGS...` (launch.cpp). */
void add_launch(CLI::App& app);

/** `quanta train [--steps N | --epochs N] [--quantizer TYPE] ...` (train.cpp). */
void add_train(CLI::App& app);

/** `quanta eval CHECKPOINT`: test metrics and reconstructions; `quanta eval
 * --model DIR --data TOKENS --seq-len N`: a language model's perplexity
 * (eval.cpp). */
void add_eval(CLI::App& app);

/** `quanta generate --model DIR --prompt-ids 1,2,3`: new tokens (generate.cpp). */
void add_generate(CLI::App& app);

/** `quanta tokenize --model DIR --text FILE --out TOKENS`: text to a token
 * file (tokenize.cpp). */
void add_tokenize(CLI::App& app);

/** `quanta encode CHECKPOINT --out CODES`: images to indices (encode.cpp). */
void add_encode(CLI::App& app);

/** `quanta decode CHECKPOINT CODES --out PNG`: indices to images (decode.cpp). */
void add_decode(CLI::App& app);

}  // namespace quanta::cli
