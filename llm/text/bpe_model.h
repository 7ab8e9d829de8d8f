#pragma once
// The model half of a BPE tokenizer.json: a pre-token to ids by the
// merges' ranks, as Hugging Face tokenizers' BPE model computes it, for the
// byte-level ones (GPT-2's, Llama 3's, Qwen's, SmolLM's, OLMo's, Granite's:
// pre-tokens written in GPT-2's byte-level characters) and the ones converted
// from SentencePiece (Llama 2's, Mistral's, Gemma's: byte fallback).
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

/** The bytes `token` (byte-level characters) stands for; a token holding a
 * character outside the map stands for its own UTF-8 bytes, as tokenizers'
 * ByteLevel decoder takes it. */
std::string bytes_of_byte_level(const std::string& text);

/** How a BPE model reads a character its vocabulary lacks. */
struct BpeUnknowns {
  int64_t unk_id = -1;         // the unk_token's id (-1: none, an error)
  bool fuse_unk = false;       // a run of unknown characters is one unk
  bool byte_fallback = false;  // each byte as its "<0xXX>" token, where all exist
};

class BpeModel {
 public:
  /** `merges` in rank order (the first merges first); each pair's parts and
   * its concatenation must be in `vocab`. ignore_merges: a pre-token that is
   * itself in the vocabulary is that token (Llama 3's). Throws
   * std::invalid_argument naming `source` and the merge that is wrong. */
  BpeModel(std::unordered_map<std::string, int64_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
           BpeUnknowns unknowns, const std::string& source);

  /** Appends the ids of `word` (one pre-token): starting from its
   * characters, the adjacent pair of lowest rank merges (the leftmost
   * first), again and again, as tokenizers' heap of merges does, until no
   * pair has a merge. */
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
  // The word's characters as ids (unknown ones as BpeUnknowns says).
  std::vector<int64_t> initial_symbols(const std::string& word) const;

  std::string source_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> tokens_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: first id << 32 | second id
  bool ignore_merges_;
  BpeUnknowns unknowns_;
  std::array<int64_t, 256> byte_ids_{};  // "<0xXX>"'s ids (-1: absent)
  // Words seen before, as tokenizers caches them: text repeats its words.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace quanta::llm
