#pragma once
// The model half of a byte-level BPE tokenizer (GPT-2's, and Llama 3's,
// Qwen's, SmolLM's, OLMo's, Granite's tokenizer.json): a pre-token, written
// in GPT-2's byte-level characters, to ids by the merges' ranks, as Hugging
// Face tokenizers' BPE model computes it.
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace quanta::llm {

/** GPT-2's map of each byte to a printable character (as UTF-8): the
 * printable Latin-1 bytes stand for themselves, the other 68 for U+0100
 * onwards in byte order. Byte-level vocabularies are written in these. */
const std::array<std::string, 256>& byte_level_chars();

/** The bytes `text` (byte-level characters) stands for; a character outside
 * the map stands for its own UTF-8 bytes. */
std::string bytes_of_byte_level(const std::string& text);

class BpeModel {
 public:
  /** `merges` in rank order (the first merges first); each pair's parts and
   * its concatenation must be in `vocab`. ignore_merges: a pre-token that is
   * itself in the vocabulary is that token (Llama 3's). unk_id: the id of a
   * character outside the vocabulary (-1: an error). Throws
   * std::invalid_argument naming `source` and the merge that is wrong. */
  BpeModel(std::unordered_map<std::string, int64_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
           int64_t unk_id, const std::string& source);

  /** Appends the ids of `word` (one pre-token, byte-level characters):
   * starting from its characters, the adjacent pair of lowest rank merges,
   * each of its occurrences left to right, until no pair has a merge. */
  void encode(const std::string& word, std::vector<int64_t>& out) const;

  /** The id of `token`, or -1. */
  int64_t id_of(const std::string& token) const;
  /** The token of `id` ("" for an id no vocabulary entry has). */
  const std::string& token_of(int64_t id) const;
  /** 1 + the largest id. */
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  struct Merge {
    int64_t rank, merged;
  };
  std::vector<int64_t> merge_word(const std::string& word) const;

  std::string source_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> tokens_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: first id << 32 | second id
  bool ignore_merges_;
  int64_t unk_id_;
  // Words seen before, as tokenizers caches them: text repeats its words.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace quanta::llm
