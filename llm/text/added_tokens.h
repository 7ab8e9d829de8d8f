#pragma once
// A tokenizer's added tokens (<|im_start|>, <s>, [INST], ...): written in a
// text, they are split out of it before the model sees the rest, as Hugging
// Face tokenizers splits them: leftmost and longest, a single_word one only
// where no word character touches it, an lstrip or rstrip one taking the
// whitespace beside it. Both kinds of tokenizer file use it (private to
// llm/text).
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

struct AddedToken {
  std::string content;
  int64_t id = -1;
  bool lstrip = false, rstrip = false, single_word = false;
  bool special = false;  // left out of decoded text
};

class AddedTokens {
 public:
  AddedTokens() = default;
  /** Throws std::invalid_argument naming `where` for an empty content or a
   * negative id. Of two of the same content, the first matches. */
  AddedTokens(std::vector<AddedToken> tokens, const std::string& where);

  /** The ids of `text`: its added tokens', and for each stretch between
   * them what `stretch` appends (`first`: the stretch starts the text),
   * each stretch noted in `segments` when given. */
  using Stretch =
      std::function<void(const std::string& stretch, bool first, std::vector<int64_t>& ids)>;
  std::vector<int64_t> encode(const std::string& text, const Stretch& stretch,
                              std::vector<TextSegment>* segments) const;

  /** The tokens of `ids` as a decoder takes them, as tokenizers'
   * decode(skip_special_tokens=True) lists them: special added tokens left
   * out, every other id through `token` (an added token's content, a
   * model's piece). */
  std::vector<std::string> visible_tokens(const std::vector<int64_t>& ids,
                                          const std::function<std::string(int64_t)>& token) const;

  /** The added token of `id`, or null. */
  const AddedToken* by_id(int64_t id) const;
  /** One past the largest id (0 when there are none). */
  int64_t end_id() const { return end_id_; }
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  /** The text between added tokens, to encode, and where in the text it
   * begins (0: it starts the text). */
  using Segment = std::function<void(const std::string& segment, std::size_t begin)>;
  /** Walks `text`: each stretch between added tokens to `segment` (empty
   * ones too), each added token's id appended to `ids` in between. */
  void split(const std::string& text, const Segment& segment, std::vector<int64_t>& ids) const;

  // The longest added token at text[i], or null.
  const AddedToken* at(const std::string& text, size_t i) const;

  std::vector<AddedToken> tokens_;
  std::array<std::vector<size_t>, 256> by_first_byte_;  // indices into tokens_
  std::unordered_map<int64_t, size_t> by_id_;
  int64_t end_id_ = 0;
};

}  // namespace quanta::llm
