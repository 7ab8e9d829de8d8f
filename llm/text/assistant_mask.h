#pragma once
// Which tokens of a rendered conversation its chat template marked as the
// assistant's ({% generation %} blocks), as transformers'
// apply_chat_template(return_assistant_tokens_mask=True) marks them: for
// each span, from the token holding its first byte to the token holding its
// last. TRL's assistant_only_loss scores those tokens alone.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

/** The encoding of a prefix text[0, at) of a text: its first `known` ids
 * are the whole text's first `known` (they need no encoding again), `tail`
 * the rest. */
struct PrefixIds {
  std::size_t known = 0;
  std::vector<int64_t> tail;
};
using PrefixEncoder = std::function<PrefixIds(std::size_t at)>;

/** `ids` (the tokens of `text`) marked true where they fall in one of
 * `spans` ([begin, end) byte ranges of `text`; empty ones mark nothing).
 * Tokens carry no offsets here, so a character's token is found by encoding
 * the text before it (`prefix`): the tokens that leaves unchanged lie before
 * the character and the next one holds it, unless the character adds no
 * token (then a space a SentencePiece normalizer drops at a text's end
 * starts the next token, and any other character joined the one before, as
 * a run of unknown characters fused into one); where the character's
 * arrival changes a token, that token holds it. A span whose last character
 * no token holds runs to the end, as transformers' does. Checked against
 * transformers' masks for byte-level BPE, Metaspace and SentencePiece
 * tokenizers (tests/data/llm/chat/assistant_masks.json). */
std::vector<bool> tokens_in_spans(const std::vector<int64_t>& ids, const std::string& text,
                                  const std::vector<std::pair<std::size_t, std::size_t>>& spans,
                                  const PrefixEncoder& prefix);

/** Prefixes of `text` through `tokenizer`, which gave `segments` (its
 * stretches between special tokens, Tokenizer::encode): a prefix ending
 * inside a stretch re-encodes that stretch's start alone, so a long
 * conversation costs the length of its stretches, not of the whole text
 * once per span. A prefix ending elsewhere is encoded whole (no BOS). */
PrefixEncoder stretch_prefixes(const Tokenizer& tokenizer, const std::string& text,
                               const std::vector<TextSegment>& segments);

}  // namespace quanta::llm
