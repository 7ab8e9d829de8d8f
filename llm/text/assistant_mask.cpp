#include "llm/text/assistant_mask.h"

#include <algorithm>
#include <stdexcept>

namespace quanta::llm {
namespace {

// How many leading tokens of `ids` encoding text[0, at) leaves as they are;
// `whole`: all of that encoding's.
std::size_t unchanged_before(const std::vector<int64_t>& ids, std::size_t at,
                             const PrefixEncoder& prefix, bool* whole) {
  const PrefixIds p = prefix(at);
  std::size_t same = std::min(p.known, ids.size());
  for (std::size_t k = 0; k < p.tail.size() && same < ids.size() && p.tail[k] == ids[same]; ++k)
    ++same;
  *whole = same == p.known + p.tail.size();
  return same;
}

// The length of the UTF-8 character starting at text[at] (1 for a stray
// continuation byte).
std::size_t char_length(const std::string& text, std::size_t at) {
  const auto lead = static_cast<unsigned char>(text[at]);
  const std::size_t n = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  return std::min(n, text.size() - at);
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// The index into `ids` of the token holding the character at byte `at` of
// `text`. Encoding text[0, at) leaves the tokens before it as they are; when
// it leaves them all, the character starts the next token, unless adding it
// adds no token: then a character that is not a space went into the token
// before (a run of unknown characters fused into one keeps its id), while a
// space a normalizer drops at the end of a text starts the next (a
// SentencePiece word boundary). When the boundary changes a token, that one
// holds it. None (npos) past the last token.
std::size_t token_holding(const std::vector<int64_t>& ids, const std::string& text, std::size_t at,
                          const PrefixEncoder& prefix) {
  bool whole = false;
  const std::size_t before = unchanged_before(ids, at, prefix, &whole);
  if (!whole) return before;
  if (before > 0 && !is_space(text[at])) {
    bool through_whole = false;
    const std::size_t through =
        unchanged_before(ids, at + char_length(text, at), prefix, &through_whole);
    if (through_whole && through == before) return before - 1;
  }
  return before < ids.size() ? before : std::string::npos;
}

}  // namespace

std::vector<bool> tokens_in_spans(const std::vector<int64_t>& ids, const std::string& text,
                                  const std::vector<std::pair<std::size_t, std::size_t>>& spans,
                                  const PrefixEncoder& prefix) {
  std::vector<bool> mask(ids.size(), false);
  for (const auto& [begin, end] : spans) {
    if (end > text.size() || begin > end)
      throw std::invalid_argument("a span [" + std::to_string(begin) + ", " + std::to_string(end) +
                                  ") is not inside the " + std::to_string(text.size()) +
                                  "-byte text");
    if (begin == end) continue;
    // From the token of the span's first character to that of its last.
    const std::size_t first = token_holding(ids, text, begin, prefix);
    if (first == std::string::npos) break;
    std::size_t back = end - 1;
    while (back > begin && (static_cast<unsigned char>(text[back]) & 0xC0) == 0x80) --back;
    std::size_t last = token_holding(ids, text, back, prefix);
    if (last == std::string::npos) last = ids.size() - 1;
    for (std::size_t t = first; t <= last; ++t) mask[t] = true;
  }
  return mask;
}

PrefixEncoder stretch_prefixes(const Tokenizer& tokenizer, const std::string& text,
                               const std::vector<TextSegment>& segments) {
  return [&tokenizer, &text, &segments](std::size_t at) {
    // The stretch holding `at` (its start to its end, both ends included).
    const auto after =
        std::upper_bound(segments.begin(), segments.end(), at,
                         [](std::size_t a, const TextSegment& s) { return a < s.begin; });
    if (after != segments.begin()) {
      const TextSegment& s = *(after - 1);
      if (at <= s.end)
        return PrefixIds{
            s.first_id, tokenizer.encode_stretch(text.substr(s.begin, at - s.begin), s.begin == 0)};
    }
    return PrefixIds{0, tokenizer.encode(text.substr(0, at), false)};
  };
}

}  // namespace quanta::llm
