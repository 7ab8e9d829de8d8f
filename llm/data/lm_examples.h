#pragma once
// Training and evaluation examples for a causal language model: the
// consecutive windows of a token file (or of ids in memory), with the
// documents inside a window told apart where the stream marks them, or the
// lines of a JSONL file (one example each, with its labels; or several
// packed into one row, told apart by restarting positions), batched as ids
// and labels padded on the right (a causal model's real tokens never see
// the padding after them).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "llm/data/token_file.h"
#include "llm/data/token_jsonl.h"

namespace quanta::llm {

/** A batch: ids and labels [rows, length] (i64), length the longest row;
 * padding has id 0 and label -100. */
struct LmBatch {
  Tensor ids, labels;
  /** Packed examples, or windows split into documents: [rows, length]
   * (i64), each example's (document's) positions 0, 1, ... (the padding
   * after them a run of its own), for CausalLM::hidden_states, which keeps
   * each one's attention within itself. Undefined otherwise. */
  Tensor position_ids;
  /** Positions whose next-token prediction is scored (label != -100 at
   * positions 1..length-1, as causal_lm_loss counts them). */
  int64_t scored_tokens = 0;
  /** Each row's tokens before its padding (transformers' attention_mask
   * as counts). */
  std::vector<int64_t> lengths{};
};

/** Where the documents of a token stream (a token file, encoded text) meet,
 * by the ids that mark them. A window then holds each document's tokens
 * apart as packed JSONL examples are (their own positions from 0 and
 * attention within the document), and a document's first token is not
 * scored as a prediction from the document before it, as transformers'
 * DataCollatorWithFlattening labels packed sequences. A window that starts
 * inside a document starts it at position 0, as before. */
struct DocumentBoundaries {
  /** A document starts at each of these ids (a BOS; llm.c's GPT-2 files'
   * <|endoftext|>, which precedes each document). */
  std::vector<int64_t> start_ids{};
  /** A document ends with each of these ids (an EOS): the token after one
   * starts the next. */
  std::vector<int64_t> end_ids{};
  bool any() const { return !start_ids.empty() || !end_ids.empty(); }
};

/** How a file becomes examples. */
struct LmDataOptions {
  /** Prompt-completion lines (token_jsonl.h). */
  PromptCompletion prompts{};
  /** Packs the examples into rows of up to seq_len tokens, in file order (a
   * new row when the next example does not fit), so that a batch carries
   * few padding tokens. Each example keeps its own positions and attention
   * (LmBatch::position_ids), and the first token of each is not predicted
   * from the one before it: the loss equals that of the examples alone.
   * Only for JSONL: a token file's windows are full already. */
  bool pack = false;
  /** Only for token streams (a JSONL line is a document already). */
  DocumentBoundaries documents{};
};

class LmExamples {
 public:
  /** The windows [i L, (i + 1) L) of token file `path`, L = seq_len (a
   * partial last window is left out); every id must be below vocab_size.
   * Throws std::runtime_error naming the file when it holds less than one
   * window, std::invalid_argument for a boundary id outside the
   * vocabulary. */
  static LmExamples from_token_file(const std::string& path, int64_t seq_len, int64_t vocab_size,
                                    const DocumentBoundaries& documents = {});
  /** One example per line of a JSONL file (read_token_jsonl's format and
   * checks); a line longer than seq_len is refused naming it (nothing is
   * cut silently), as is a file with no scored token. */
  static LmExamples from_jsonl(const std::string& path, int64_t seq_len, int64_t vocab_size,
                               const LmDataOptions& options = {});
  /** The windows of `ids` held in memory (text a tokenizer encoded),
   * `source` naming them in errors. */
  static LmExamples from_ids(std::vector<int64_t> ids, const std::string& source, int64_t seq_len,
                             int64_t vocab_size, const DocumentBoundaries& documents = {});
  /** The format by extension: .jsonl or .json lines (which refuse
   * `options.documents`), else a token file (which refuses the other
   * options, naming them). */
  static LmExamples from_file(const std::string& path, int64_t seq_len, int64_t vocab_size,
                              const LmDataOptions& options = {});

  /** Examples (packed rows when packed). */
  int64_t size() const;
  /** JSONL lines read (as many as size() unless packed); windows split
   * into documents: the documents in them (a window's first token counted
   * as one only where marked). */
  int64_t documents() const { return documents_; }
  bool packed() const { return !positions_.empty(); }
  /** Whether batches carry LmBatch::position_ids (packed, or windows split
   * into documents). */
  bool has_position_ids() const { return packed() || documents_in_windows_.any(); }
  /** The longest an example may be. */
  int64_t seq_len() const { return seq_len_; }
  const std::string& path() const { return path_; }
  /** Examples `rows` (i64 positions, any device; read on the host), on
   * `device`. */
  LmBatch batch(const Tensor& rows, Device device = Device::cpu()) const;
  /** Scored positions of examples `rows` without building the batch. */
  int64_t scored_tokens(const Tensor& rows) const;
  /** Scored positions of every example (windows split into documents:
   * every window read). */
  int64_t total_scored_tokens() const;

 private:
  LmExamples() = default;
  bool windowed() const;
  std::vector<int64_t> window(int64_t i) const;
  void split_windows(const DocumentBoundaries& documents);
  void pack();
  std::string path_;
  int64_t seq_len_ = 0;
  std::shared_ptr<TokenFile> tokens_;   // windows of a token file, or
  std::vector<int64_t> ids_;            // of ids in memory, or
  std::vector<TokenExample> examples_;  // the lines of a JSONL file
  int64_t windows_ = 0;
  std::vector<int64_t> scored_;                  // per JSONL example or split window
  std::vector<std::vector<int64_t>> positions_;  // per packed row
  int64_t documents_ = 0;
  int64_t vocab_size_ = 0;
  DocumentBoundaries documents_in_windows_;
};

}  // namespace quanta::llm
