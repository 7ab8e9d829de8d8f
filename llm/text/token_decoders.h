#pragma once
// A tokenizer.json's decoder: tokens back to text, each step as Hugging Face
// tokenizers' decoder of that name runs it over the list of tokens.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::llm {

struct TokenDecoder {
  enum class Kind {
    byte_level,     // GPT-2's characters to bytes, the whole list one text
    replace,        // `pattern` replaced by `content` in each token
    byte_fallback,  // runs of "<0xXX>" tokens to their bytes' text
    fuse,           // the list joined into one token
    strip,          // up to `start` leading and `stop` trailing `content`s off each token
    metaspace,      // `pattern` (U+2581) to a space; in the first token dropped when `prepend`
  };
  Kind kind;
  std::string pattern, content;
  int64_t start = 0, stop = 0;
  bool prepend = false;
};

/** The text of `tokens` through `steps` in order, the resulting tokens
 * joined. Bytes that are not UTF-8 become U+FFFD, as tokenizers' lossy
 * conversion makes them. */
std::string decode_tokens(std::vector<std::string> tokens, const std::vector<TokenDecoder>& steps);

}  // namespace quanta::llm
