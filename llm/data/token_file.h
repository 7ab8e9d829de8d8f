#pragma once
// Token files as llm.c writes them (dev/data/data_common.py, write_datafile):
// a header of 256 little-endian int32 (magic, version, token count, zeros),
// then the ids. Magic 20240520 version 1: uint16 ids (GPT-2 vocabularies);
// magic 20240801 version 7: uint32 ids (Llama 3's). A file is opened once and
// read in windows with pread, never mapped: a file cut or replaced while
// open gives an error naming it, not a SIGBUS.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::llm {

/** How wide a token file's ids are. */
enum class TokenWidth : uint8_t { u16, u32 };

/** Magic numbers and versions of the two layouts. */
inline constexpr int32_t kTokenMagicU16 = 20240520, kTokenVersionU16 = 1;
inline constexpr int32_t kTokenMagicU32 = 20240801, kTokenVersionU32 = 7;
/** Header length in int32 words. */
inline constexpr int64_t kTokenHeaderWords = 256;

class TokenFile {
 public:
  /** Opens `path` and checks its header: a known magic with its version, a
   * token count >= 0, and a file size that holds exactly that many ids.
   * Throws std::runtime_error "PATH: what is wrong". */
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;

  /** Tokens in the file. */
  int64_t size() const { return count_; }
  TokenWidth width() const { return width_; }
  const std::string& path() const { return path_; }

  /** Tokens [begin, begin + n) of the file. With vocab_size > 0, an id
   * >= vocab_size throws naming the file and the token's position. A range
   * outside [0, size()) throws std::out_of_range; a file that shrank since
   * it was opened throws std::runtime_error naming it. */
  std::vector<int64_t> read(int64_t begin, int64_t n, int64_t vocab_size = 0) const;

 private:
  std::string path_;
  int fd_ = -1;
  TokenWidth width_ = TokenWidth::u16;
  int64_t count_ = 0;
};

/** Writes `ids` as a token file of `width` (every id must fit it), whole or
 * not at all (a temporary file, renamed): for tests and tools that convert
 * data. Throws std::invalid_argument for an id that does not fit. */
void write_token_file(const std::string& path, const std::vector<int64_t>& ids, TokenWidth width);

}  // namespace quanta::llm
