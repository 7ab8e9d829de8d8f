// Byte-level BPE: GPT-2's byte map, and merges applied by rank.
#include "llm/text/bpe_model.h"

#include <cstdio>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>

namespace quanta::llm {
namespace {

// One UTF-8 character's length from its first byte (1 for a stray byte).
size_t utf8_length(unsigned char lead) {
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

constexpr uint64_t pair_key(int64_t a, int64_t b) {
  return static_cast<uint64_t>(a) << 32 | static_cast<uint64_t>(b);
}

}  // namespace

const std::array<std::string, 256>& byte_level_chars() {
  static const std::array<std::string, 256> chars = [] {
    std::array<std::string, 256> c;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      c[b] = utf8_of(printable ? b : next++);
    }
    return c;
  }();
  return chars;
}

std::string bytes_of_byte_level(const std::string& token) {
  static const std::unordered_map<std::string, char> bytes = [] {
    std::unordered_map<std::string, char> m;
    const auto& chars = byte_level_chars();
    for (int b = 0; b < 256; ++b) m.emplace(chars[b], static_cast<char>(b));
    return m;
  }();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(token[i])), token.size() - i);
    const auto it = bytes.find(token.substr(i, n));
    if (it == bytes.end()) return token;
    out += it->second;
    i += n;
  }
  return out;
}

BpeModel::BpeModel(std::unordered_map<std::string, int64_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   bool ignore_merges, BpeUnknowns unknowns, const std::string& source)
    : source_(source),
      vocab_(std::move(vocab)),
      ignore_merges_(ignore_merges),
      unknowns_(unknowns) {
  int64_t size = 0;
  for (const auto& [token, id] : vocab_) {
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      throw std::invalid_argument(source_ + ": vocabulary id " + std::to_string(id) + " of \"" +
                                  token + "\" is outside 0..2^31-1");
    size = std::max(size, id + 1);
  }
  tokens_.resize(static_cast<size_t>(size));
  for (const auto& [token, id] : vocab_) tokens_[static_cast<size_t>(id)] = token;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const int64_t ia = id_of(a), ib = id_of(b), merged = id_of(a + b);
    if (ia < 0 || ib < 0 || merged < 0)
      throw std::invalid_argument(source_ + ": merge " + std::to_string(rank) + " (\"" + a +
                                  "\" \"" + b + "\") names " +
                                  (ia < 0   ? "\"" + a + "\", which"
                                   : ib < 0 ? "\"" + b + "\", which"
                                            : "\"" + a + b + "\", which") +
                                  " the vocabulary does not hold");
    // The first of a repeated pair wins, as tokenizers reads them.
    merges_.emplace(pair_key(ia, ib), Merge{static_cast<int64_t>(rank), merged});
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    byte_ids_[static_cast<size_t>(b)] = id_of(name);
  }
}

int64_t BpeModel::id_of(const std::string& token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

const std::string& BpeModel::token_of(int64_t id) const {
  static const std::string none;
  return id >= 0 && id < size() ? tokens_[static_cast<size_t>(id)] : none;
}

std::vector<int64_t> BpeModel::initial_symbols(const std::string& word) const {
  std::vector<int64_t> symbols;
  bool last_unknown = false;
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    const std::string c = word.substr(i, n);
    i += n;
    const int64_t id = id_of(c);
    if (id >= 0) {
      symbols.push_back(id);
      last_unknown = false;
      continue;
    }
    if (unknowns_.byte_fallback) {
      bool all = true;
      for (const char b : c) all = all && byte_ids_[static_cast<unsigned char>(b)] >= 0;
      if (all) {
        for (const char b : c) symbols.push_back(byte_ids_[static_cast<unsigned char>(b)]);
        last_unknown = false;
        continue;
      }
    }
    if (unknowns_.unk_id < 0)
      throw std::invalid_argument(source_ + ": the character \"" + c +
                                  "\" is not in the vocabulary and there is no unk_token");
    if (!(unknowns_.fuse_unk && last_unknown)) symbols.push_back(unknowns_.unk_id);
    last_unknown = true;
  }
  return symbols;
}

std::vector<int64_t> BpeModel::merge_word(const std::string& word) const {
  // The symbols as a linked list, and a heap of the merges their adjacent
  // pairs have, lowest rank first, then leftmost: an entry whose pair has
  // changed since it was pushed is passed over.
  struct Symbol {
    int64_t id;
    int64_t prev, next;
    bool alive;
  };
  struct Entry {
    int64_t rank, pos, merged;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Symbol> sym;
  for (const int64_t id : initial_symbols(word)) {
    const auto n = static_cast<int64_t>(sym.size());
    sym.push_back({id, n - 1, n + 1, true});
  }
  if (sym.empty()) return {};
  sym.back().next = -1;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  const auto push = [&](int64_t pos) {
    const int64_t next = sym[static_cast<size_t>(pos)].next;
    if (next < 0) return;
    const auto it =
        merges_.find(pair_key(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(next)].id));
    if (it != merges_.end()) heap.push({it->second.rank, pos, it->second.merged});
  };
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(sym.size()); ++i) push(i);
  while (!heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    Symbol& left = sym[static_cast<size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(left.next)];
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.merged != top.merged) continue;
    left.id = top.merged;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
  std::vector<int64_t> out;
  for (int64_t i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next)
    out.push_back(sym[static_cast<size_t>(i)].id);
  return out;
}

void BpeModel::encode(const std::string& word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const int64_t id = id_of(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  {
    const std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int64_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  const std::lock_guard<std::mutex> lock(cache_mutex_);
  // Words, not documents (a SentencePiece-style tokenizer's whole segment).
  if (word.size() <= 256 && cache_.size() < (size_t{1} << 20)) cache_.emplace(word, std::move(ids));
}

}  // namespace quanta::llm
