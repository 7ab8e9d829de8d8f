#pragma once
// Text to token ids and back through a model folder's SentencePiece
// tokenizer.model (Llama 1/2, TinyLlama, Mistral v0.1 ship one), with
// Debian's libsentencepiece: what transformers' LlamaTokenizer does (the
// pieces of the text, a BOS id in front when asked). Models that ship only a
// tokenizer.json (Llama 3, Qwen2, SmolLM2) are tokenized ahead of time by
// tools/tokenize.py into an llm.c token file.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace quanta::llm {

class Tokenizer {
 public:
  /** Loads `path` (a tokenizer.model). Throws std::runtime_error naming the
   * file when it cannot be read or parsed, or when quanta was built without
   * libsentencepiece (saying how to get it). */
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  /** The ids of `text`, with the BOS id first when add_bos (and the model
   * has one). */
  std::vector<int64_t> encode(const std::string& text, bool add_bos = true) const;
  /** The text of `ids` (BOS, EOS and other control ids print as nothing). */
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t vocab_size() const;
  int64_t bos_id() const;  // -1 when the model has none
  int64_t eos_id() const;  // -1 when the model has none
  const std::string& path() const { return path_; }

  /** True when quanta was built with libsentencepiece. */
  static bool available();

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

/** DIR/tokenizer.model when it exists, else "" (the folder has none). */
inline std::string tokenizer_model_in(const std::string& dir) {
  const auto p = std::filesystem::path(dir) / "tokenizer.model";
  return std::filesystem::exists(p) ? p.string() : std::string();
}

/** The ids of text file `path` through the tokenizer.model of model
 * folder `model_dir`, a BOS first (as a document starts). Throws
 * std::invalid_argument when the folder has no tokenizer.model (saying how
 * to tokenize instead), std::runtime_error when the file cannot be read. */
std::vector<int64_t> encode_text_file(const std::string& path, const std::string& model_dir);

}  // namespace quanta::llm
