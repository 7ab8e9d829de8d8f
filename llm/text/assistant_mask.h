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

namespace quanta::llm {

/** `ids` (the tokens of `text`, as `encode` makes them) marked true where
 * they fall in one of `spans` ([begin, end) byte ranges of `text`; empty
 * ones mark nothing). Tokens carry no offsets here, so a character's token
 * is found by encoding the text before it: the tokens that leaves unchanged
 * lie before the character and the next one holds it, unless the character
 * adds no token (then a space a SentencePiece normalizer drops at a text's
 * end starts the next token, and any other character joined the one before,
 * as a run of unknown characters fused into one); where the character's
 * arrival changes a token, that token holds it. A span whose last character
 * no token holds runs to the end, as transformers' does. Checked against
 * transformers' masks for byte-level BPE, Metaspace and SentencePiece
 * tokenizers (tests/data/llm/chat/assistant_masks.json). */
std::vector<bool> tokens_in_spans(
    const std::vector<int64_t>& ids, const std::string& text,
    const std::vector<std::pair<std::size_t, std::size_t>>& spans,
    const std::function<std::vector<int64_t>(const std::string& text)>& encode);

}  // namespace quanta::llm
