#pragma once
// What each kind of tokenizer file gives Tokenizer (private to llm/text):
// SentencePiece's tokenizer.model, or a BPE tokenizer.json.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

struct Tokenizer::Impl {
  virtual ~Impl() = default;
  /** The ids of `text`, no BOS: its special tokens split out, each stretch
   * between them encoded on its own (noted in `segments` when given). */
  virtual std::vector<int64_t> encode(const std::string& text,
                                      std::vector<TextSegment>* segments) const = 0;
  /** Appends the ids of `stretch`, a stretch of text between special tokens
   * (`first`: it starts the text), encoded on its own. */
  virtual void encode_stretch(const std::string& stretch, bool first,
                              std::vector<int64_t>& ids) const = 0;
  /** The text of `ids`, each inside the vocabulary (Tokenizer checks). */
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  /** The vocabulary entry of a valid `id` (an added token's content). */
  virtual std::string token(int64_t id) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t bos_id() const = 0;
  virtual int64_t eos_id() const = 0;
};

/** A tokenizer.model through libsentencepiece; in a build without it,
 * throws saying how to get it. */
std::unique_ptr<Tokenizer::Impl> sentencepiece_tokenizer(const std::string& path);
bool sentencepiece_available();

/** A BPE tokenizer.json (tokenizer_json.cpp, on ICU's regular expressions
 * and normalizer); in a build without ICU, throws saying how to get it. */
std::unique_ptr<Tokenizer::Impl> json_tokenizer(const std::string& path);
bool json_tokenizer_available();

}  // namespace quanta::llm
