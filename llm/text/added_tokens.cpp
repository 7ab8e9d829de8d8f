// Added tokens split out of a text as tokenizers splits them, with ICU's
// Unicode properties for the whitespace lstrip/rstrip take and the word
// characters single_word looks for.
#include "llm/text/added_tokens.h"

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <stdexcept>

namespace quanta::llm {
namespace {

bool is_whitespace_at(const std::string& text, size_t i, size_t* length) {
  UChar32 c;
  int32_t at = static_cast<int32_t>(i);
  U8_NEXT(reinterpret_cast<const uint8_t*>(text.data()), at, static_cast<int32_t>(text.size()), c);
  *length = static_cast<size_t>(at) - i;
  return c >= 0 && u_isUWhiteSpace(c);
}

// The whitespace character ending at `end` (its start), or npos.
size_t whitespace_before(const std::string& text, size_t end) {
  if (end == 0) return std::string::npos;
  size_t start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  size_t n = 0;
  return is_whitespace_at(text, start, &n) && start + n == end ? start : std::string::npos;
}

// Rust's Unicode \w, which tokenizers' single_word tests beside a match.
bool is_word_char(UChar32 c) {
  const int8_t type = u_charType(c);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || type == U_NON_SPACING_MARK ||
         type == U_ENCLOSING_MARK || type == U_COMBINING_SPACING_MARK ||
         type == U_DECIMAL_DIGIT_NUMBER || type == U_CONNECTOR_PUNCTUATION ||
         u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL);
}

// Whether text[begin, end) stands alone: no word character just before or
// after it.
bool single_word_at(const std::string& text, size_t begin, size_t end) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const auto n = static_cast<int32_t>(text.size());
  if (begin > 0) {
    auto at = static_cast<int32_t>(begin);
    UChar32 c;
    U8_PREV(bytes, 0, at, c);
    if (c >= 0 && is_word_char(c)) return false;
  }
  if (end < text.size()) {
    auto at = static_cast<int32_t>(end);
    UChar32 c;
    U8_NEXT(bytes, at, n, c);
    if (c >= 0 && is_word_char(c)) return false;
  }
  return true;
}

}  // namespace

AddedTokens::AddedTokens(std::vector<AddedToken> tokens, const std::string& where)
    : tokens_(std::move(tokens)) {
  for (size_t k = 0; k < tokens_.size(); ++k) {
    const AddedToken& t = tokens_[k];
    if (t.content.empty() || t.id < 0)
      throw std::invalid_argument(where + ": added token \"" + t.content + "\" (id " +
                                  std::to_string(t.id) + ") is empty or has an id < 0");
    by_first_byte_[static_cast<unsigned char>(t.content[0])].push_back(k);
    by_id_.emplace(t.id, k);  // the first of an id decodes it
    end_id_ = std::max(end_id_, t.id + 1);
  }
}

const AddedToken* AddedTokens::by_id(int64_t id) const {
  const auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

const AddedToken* AddedTokens::at(const std::string& text, size_t i) const {
  const AddedToken* best = nullptr;
  for (const size_t k : by_first_byte_[static_cast<unsigned char>(text[i])]) {
    const AddedToken& a = tokens_[k];
    if (text.compare(i, a.content.size(), a.content) == 0 &&
        (!best || a.content.size() > best->content.size()))
      best = &a;
  }
  return best;
}

void AddedTokens::split(const std::string& text, const Segment& segment,
                        std::vector<int64_t>& ids) const {
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = at(text, i);
    if (!hit) {
      ++i;
      continue;
    }
    // A single_word token inside a word is no match, and hides any shorter
    // one there, as tokenizers filters its leftmost-longest matches.
    if (hit->single_word && !single_word_at(text, i, i + hit->content.size())) {
      i += hit->content.size();
      continue;
    }
    // lstrip and rstrip: the token takes the whitespace beside it.
    size_t segment_end = i;
    if (hit->lstrip)
      for (size_t w;
           segment_end > start && (w = whitespace_before(text, segment_end)) != std::string::npos;)
        segment_end = w;
    segment(text.substr(start, segment_end - start), start);
    ids.push_back(hit->id);
    i += hit->content.size();
    if (hit->rstrip)
      for (size_t n; i < text.size() && is_whitespace_at(text, i, &n);) i += n;
    start = i;
  }
  segment(text.substr(start), start);
}

std::vector<std::string> AddedTokens::visible_tokens(
    const std::vector<int64_t>& ids, const std::function<std::string(int64_t)>& token) const {
  std::vector<std::string> tokens;
  for (const int64_t id : ids) {
    const AddedToken* added = by_id(id);
    if (!added || !added->special) tokens.push_back(token(id));
  }
  return tokens;
}

std::vector<int64_t> AddedTokens::encode(const std::string& text, const Stretch& stretch,
                                         std::vector<TextSegment>* segments) const {
  std::vector<int64_t> ids;
  split(
      text,
      [&](const std::string& piece, std::size_t begin) {
        const std::size_t first_id = ids.size();
        stretch(piece, begin == 0, ids);
        if (segments && !piece.empty())
          segments->push_back({begin, begin + piece.size(), first_id, ids.size() - first_id});
      },
      ids);
  return ids;
}

}  // namespace quanta::llm
