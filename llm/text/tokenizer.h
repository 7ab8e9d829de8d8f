#pragma once
// Text to token ids and back through a model folder's tokenizer: its
// SentencePiece tokenizer.model (Llama 1/2, Mistral, Gemma, Phi-3 ship one),
// read by Debian's libsentencepiece as transformers' LlamaTokenizer reads
// it, or its BPE tokenizer.json (Llama 3, Qwen2/2.5/3, SmolLM, OLMo,
// Granite ship only that; byte-level, or converted from SentencePiece with
// byte fallback), read as Hugging Face tokenizers reads it, with ICU for its
// Unicode expressions and NFC.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace quanta::llm {

/** A stretch of a text between the special tokens written in it, which a
 * tokenizer encodes on its own: bytes [begin, end) of the text, ids
 * [first_id, first_id + ids) of its encoding. */
struct TextSegment {
  std::size_t begin = 0, end = 0;
  std::size_t first_id = 0, ids = 0;
};

class Tokenizer {
 public:
  struct Impl;  // one per kind of file (llm/text/tokenizer_impl.h)

  /** Loads `path`: a tokenizer.json (by its extension) or a
   * tokenizer.model. Throws naming the file when it cannot be read or
   * parsed, when it holds what quanta does not run (another tokenizer.json
   * model or pre-tokenizer, named), or when quanta was built without the
   * library it needs (saying how to get it). */
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  /** The ids of `text`, with the BOS id first when add_bos (and the model
   * has one: a tokenizer.json's, the first special token of its
   * post-processor's template). Special tokens written in the text (a
   * tokenizer.json's added tokens, e.g. <|im_start|>) are their ids, as
   * tokenizers encodes them. `segments`, when given, gets the stretches
   * between them. */
  std::vector<int64_t> encode(const std::string& text, bool add_bos = true,
                              std::vector<TextSegment>* segments = nullptr) const;
  /** The ids `encode` gives a stretch of text between special tokens
   * (`first`: one that starts its text), on its own: what a TextSegment's
   * bytes, or a start of them, encode to. */
  std::vector<int64_t> encode_stretch(const std::string& stretch, bool first) const;
  /** The text of `ids` (BOS, EOS and other control or special ids print as
   * nothing). */
  std::string decode(const std::vector<int64_t>& ids) const;

  /** The vocabulary entry of `id` as the tokenizer file spells it ("<s>",
   * "▁hello", "Ġworld"; an added token's content); throws
   * std::invalid_argument for an id outside the vocabulary. */
  std::string token(int64_t id) const;

  int64_t vocab_size() const;
  int64_t bos_id() const;  // -1 when the model has none
  /** -1 when the model has none; a tokenizer.json's is the eos_token of the
   * tokenizer_config.json beside it, else config.json's eos_token_id. */
  int64_t eos_id() const;
  const std::string& path() const { return path_; }

  /** True when this build reads `path`'s kind of file (libsentencepiece for
   * a tokenizer.model, ICU for a tokenizer.json). */
  static bool available(const std::string& path);

 private:
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

/** The tokenizer file of folder `dir`, as transformers chooses it: its
 * tokenizer.json when there is one this build reads, else its
 * tokenizer.model, else its tokenizer.json (a build without ICU then says
 * so when it is opened), else "" (the folder has neither). */
std::string tokenizer_model_in(const std::string& dir);

/** The ids of text file `path` through the tokenizer of model folder
 * `model_dir` (tokenizer_model_in), a BOS first (as a document starts).
 * Throws std::invalid_argument when the folder has no tokenizer (saying how
 * to tokenize instead), std::runtime_error when the file cannot be read. */
std::vector<int64_t> encode_text_file(const std::string& path, const std::string& model_dir);

}  // namespace quanta::llm
