#pragma once
// Examples as JSON lines: one object per line with an "input_ids" array and
// an optional "labels" array of the same length (-100 marks a position that
// is not scored, transformers' convention; without "labels", every position
// is scored on its own id), or a "prompt" and a "completion" (TRL's
// prompt-completion format: text, or arrays of ids), the completion scored
// and the prompt too unless only completions are trained on, or a "text"
// (TRL's language-modeling format: a BOS where the tokenizer has one, the
// text, its EOS), every position scored, or TRL's conversational lines: a
// "messages" list (with optional "tools") rendered by the model's chat
// template and tokenized as apply_chat_template(tokenize=True) does, every
// position scored, or a "prompt" and "completion" that are lists of
// messages (the prompt rendered with the generation prompt; the completion
// what the whole conversation adds to it).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "llm/text/jinja/template.h"
#include "llm/text/tokenizer.h"

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

/** How "prompt" / "completion" lines become ids and labels: the prompt's ids
 * (a BOS first when the encoder adds one) then the completion's (no BOS),
 * then eos_id after a text completion, so the model learns where a
 * completion ends (TRL appends the EOS too; ids are taken as they are).
 * Tokenizing the two separately keeps the boundary exact. */
struct PromptCompletion {
  /** Text to ids (add_bos: whether a BOS goes first); unset, only id arrays
   * are accepted and a text field is refused naming the line. */
  std::function<std::vector<int64_t>(const std::string& text, bool add_bos)> encode{};
  /** The tokenizer behind `encode`, where there is one: the assistant-only
   * loss then re-encodes stretches of a conversation, not whole prefixes. */
  std::shared_ptr<const Tokenizer> tokenizer{};
  /** Appended to every text completion when >= 0. */
  int64_t eos_id = -1;
  /** Labels the prompt's positions -100: the loss covers the completion
   * (and its EOS) only. Every line must then be a prompt-completion one. */
  bool completions_only = false;
  /** A conversation (a JSON array of messages, as text) through the model's
   * chat template, with `tools` (a JSON array as text, or ""), more template
   * variables (a JSON object as text, or "": a line's chat_template_kwargs)
   * and add_generation_prompt: the text and its {% generation %} spans;
   * unset, conversational lines are refused naming the line. */
  std::function<jinja::Rendered(const std::string& messages, const std::string& tools,
                                const std::string& variables, bool add_generation_prompt)>
      chat{};
  /** Labels -100 everywhere but the assistant's tokens (the chat template's
   * {% generation %} spans, as TRL's assistant_only_loss): every line must
   * then be a conversation, and mark some. With completions_only, the
   * assistant's tokens of the completion alone. */
  bool assistant_only = false;
};

/** How folder_text_reader reads a model folder's text and conversations. */
struct TextReading {
  /** PromptCompletion::completions_only and assistant_only. */
  bool completions_only = false;
  bool assistant_only = false;
  /** The chat template to render conversations with instead of the
   * folder's (TRL's chat_template_path): a .jinja file, or a folder whose
   * templates ChatTemplate::from_folder reads; empty: the model folder's. */
  std::string chat_template_path{};
};

/** JSONL text (prompt-completion pairs, TRL's text lines) through the
 * tokenizer of model folder `model_dir` (tokenizer.model or tokenizer.json;
 * none: only id arrays are read): its EOS after each completion or text;
 * conversations through its chat template (ChatTemplate::from_folder, or
 * `reading.chat_template_path`'s). A build without the library the
 * tokenizer needs fails on the first text field, saying so. Throws
 * std::invalid_argument for a chat_template_path that holds no template. */
PromptCompletion folder_text_reader(const std::string& model_dir, const TextReading& reading = {});

/** Reads every non-empty line of `path`. Each error is one
 * std::runtime_error naming the file, the line and the field ("data.jsonl:
 * line 7: labels has 12 entries, input_ids 13"): a line that is not a JSON
 * object, a missing or empty input_ids, an entry that is not a whole number,
 * a text (where there are no input_ids and no prompt) that is not a string,
 * an id outside [0, vocab_size), a label neither -100 nor a valid id, a
 * sequence longer than max_length, a line with both input_ids and a prompt,
 * a prompt without a completion, text where no encoder is given, and with
 * completions_only a line that is not a prompt-completion pair. A file with
 * no example is an error too. */
std::vector<TokenExample> read_token_jsonl(const std::string& path, const TokenLimits& limits = {},
                                           const PromptCompletion& prompts = {});

}  // namespace quanta::llm
