// Byte-level BPE: GPT-2's byte map, and merges applied by rank.
#include "llm/text/bpe_model.h"

#include <limits>
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

std::string bytes_of_byte_level(const std::string& text) {
  static const std::unordered_map<std::string, char> bytes = [] {
    std::unordered_map<std::string, char> m;
    const auto& chars = byte_level_chars();
    for (int b = 0; b < 256; ++b) m.emplace(chars[b], static_cast<char>(b));
    return m;
  }();
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(text[i])), text.size() - i);
    const std::string c = text.substr(i, n);
    const auto it = bytes.find(c);
    if (it != bytes.end())
      out += it->second;
    else
      out += c;
    i += n;
  }
  return out;
}

BpeModel::BpeModel(std::unordered_map<std::string, int64_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   bool ignore_merges, int64_t unk_id, const std::string& source)
    : source_(source), vocab_(std::move(vocab)), ignore_merges_(ignore_merges), unk_id_(unk_id) {
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
}

int64_t BpeModel::id_of(const std::string& token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

const std::string& BpeModel::token_of(int64_t id) const {
  static const std::string none;
  return id >= 0 && id < size() ? tokens_[static_cast<size_t>(id)] : none;
}

std::vector<int64_t> BpeModel::merge_word(const std::string& word) const {
  std::vector<int64_t> symbols;
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    const int64_t id = id_of(word.substr(i, n));
    if (id < 0 && unk_id_ < 0)
      throw std::invalid_argument(source_ + ": the character \"" + word.substr(i, n) +
                                  "\" is not in the vocabulary and there is no unk_token");
    symbols.push_back(id < 0 ? unk_id_ : id);
    i += n;
  }
  for (;;) {
    const Merge* best = nullptr;
    uint64_t best_key = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = merges_.find(pair_key(symbols[i], symbols[i + 1]));
      if (it != merges_.end() && (!best || it->second.rank < best->rank)) {
        best = &it->second;
        best_key = it->first;
      }
    }
    if (!best) break;
    std::vector<int64_t> next;
    next.reserve(symbols.size());
    for (size_t i = 0; i < symbols.size(); ++i) {
      if (i + 1 < symbols.size() && pair_key(symbols[i], symbols[i + 1]) == best_key) {
        next.push_back(best->merged);
        ++i;
      } else {
        next.push_back(symbols[i]);
      }
    }
    symbols = std::move(next);
  }
  return symbols;
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
  if (cache_.size() < (size_t{1} << 20)) cache_.emplace(word, std::move(ids));
}

}  // namespace quanta::llm
