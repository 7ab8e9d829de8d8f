#pragma once
// Tokenized examples as JSON lines: one object per line with an
// "input_ids" array and an optional "labels" array of the same length
// (-100 marks a position that is not scored, transformers' convention;
// without "labels", every position is scored on its own id).
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::llm {

/** transformers' label of a position the loss ignores. */
inline constexpr int64_t kIgnoreIndex = -100;

/** One example: ids and their labels, of one length. */
struct TokenExample {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

/** What a JSONL file must satisfy beyond its format (0: not checked). */
struct TokenLimits {
  /** Ids (and labels other than -100) below this. */
  int64_t vocab_size = 0;
  /** Sequences no longer than this (the model's max_position_embeddings). */
  int64_t max_length = 0;
};

/** Reads every non-empty line of `path`. Each error is one
 * std::runtime_error naming the file, the line and the field ("data.jsonl:
 * line 7: labels has 12 entries, input_ids 13"): a line that is not a JSON
 * object, a missing or empty input_ids, an entry that is not a whole number,
 * an id outside [0, vocab_size), a label neither -100 nor a valid id, a
 * sequence longer than max_length. A file with no example is an error too. */
std::vector<TokenExample> read_token_jsonl(const std::string& path, const TokenLimits& limits = {});

}  // namespace quanta::llm
