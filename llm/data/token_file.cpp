#include "llm/data/token_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace quanta::llm {
namespace {

[[noreturn]] void token_file_fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

// Exactly n bytes at offset, or an error naming the file.
void read_exact(int fd, const std::string& path, void* dst, std::size_t n, int64_t offset,
                const char* what) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      token_file_fail(path, std::string("cannot read the ") + what + ": " + std::strerror(errno));
    }
    if (got == 0)
      token_file_fail(path,
                      std::string("ends inside the ") + what + " (the file was cut or replaced)");
    p += got;
    offset += got;
    n -= static_cast<std::size_t>(got);
  }
}

int64_t id_bytes(TokenWidth w) { return w == TokenWidth::u16 ? 2 : 4; }

}  // namespace

TokenFile::TokenFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO must fail the regular-file check, not wait for a writer.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) token_file_fail(path, std::string("cannot open: ") + std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0)
      token_file_fail(path, std::string("cannot stat: ") + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) token_file_fail(path, "is not a regular file");
    const auto file_bytes = static_cast<int64_t>(st.st_size);
    const int64_t header_bytes = kTokenHeaderWords * 4;
    if (file_bytes < header_bytes)
      token_file_fail(path, "is " + std::to_string(file_bytes) +
                                " bytes, shorter than a token file's " +
                                std::to_string(header_bytes) + "-byte header");
    unsigned char raw[12];
    read_exact(fd_, path, raw, sizeof raw, 0, "header");
    auto word = [&](int i) {
      const unsigned char* b = raw + 4 * i;
      return static_cast<int32_t>(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 |
                                  uint32_t(b[3]) << 24);
    };
    const int32_t magic = word(0), version = word(1), count = word(2);
    if (magic == kTokenMagicU16) {
      width_ = TokenWidth::u16;
      if (version != kTokenVersionU16)
        token_file_fail(path, "magic " + std::to_string(magic) + " (uint16 ids) needs version " +
                                  std::to_string(kTokenVersionU16) + ", the header says " +
                                  std::to_string(version));
    } else if (magic == kTokenMagicU32) {
      width_ = TokenWidth::u32;
      if (version != kTokenVersionU32)
        token_file_fail(path, "magic " + std::to_string(magic) + " (uint32 ids) needs version " +
                                  std::to_string(kTokenVersionU32) + ", the header says " +
                                  std::to_string(version));
    } else {
      token_file_fail(path, "not an llm.c token file: magic " + std::to_string(magic) +
                                ", expected " + std::to_string(kTokenMagicU16) +
                                " (uint16 ids) or " + std::to_string(kTokenMagicU32) +
                                " (uint32 ids)");
    }
    if (count < 0)
      token_file_fail(path, "the header's token count is negative (" + std::to_string(count) + ")");
    const int64_t data_bytes = file_bytes - header_bytes;
    const int64_t want = int64_t{count} * id_bytes(width_);
    if (data_bytes < want)
      token_file_fail(path, "truncated: the header says " + std::to_string(count) + " tokens (" +
                                std::to_string(want) + " bytes), the file holds " +
                                std::to_string(data_bytes) + " bytes after the header");
    if (data_bytes > want)
      token_file_fail(path, std::to_string(data_bytes - want) + " bytes after the " +
                                std::to_string(count) + " tokens the header declares");
    count_ = count;
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

TokenFile::~TokenFile() {
  if (fd_ >= 0) ::close(fd_);
}

TokenFile::TokenFile(TokenFile&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(std::exchange(o.fd_, -1)),
      width_(o.width_),
      count_(o.count_) {}

TokenFile& TokenFile::operator=(TokenFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    width_ = o.width_;
    count_ = o.count_;
  }
  return *this;
}

std::vector<int64_t> TokenFile::read(int64_t begin, int64_t n, int64_t vocab_size) const {
  if (begin < 0 || n < 0 || begin > count_ || n > count_ - begin)
    throw std::out_of_range(path_ + ": tokens [" + std::to_string(begin) + ", " +
                            std::to_string(begin) + " + " + std::to_string(n) +
                            ") are outside the file's " + std::to_string(count_));
  const int64_t w = id_bytes(width_);
  std::vector<unsigned char> raw(static_cast<std::size_t>(n * w));
  read_exact(fd_, path_, raw.data(), raw.size(), kTokenHeaderWords * 4 + begin * w, "token ids");
  std::vector<int64_t> ids(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* b = raw.data() + i * w;
    uint32_t v = uint32_t(b[0]) | uint32_t(b[1]) << 8;
    if (w == 4) v |= uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
    if (vocab_size > 0 && int64_t{v} >= vocab_size)
      token_file_fail(path_, "token " + std::to_string(begin + i) + " is id " + std::to_string(v) +
                                 ", outside the model's vocabulary of " +
                                 std::to_string(vocab_size));
    ids[static_cast<std::size_t>(i)] = v;
  }
  return ids;
}

void write_token_file(const std::string& path, const std::vector<int64_t>& ids, TokenWidth width) {
  const int64_t w = id_bytes(width);
  const int64_t most = width == TokenWidth::u16 ? 0xFFFF : 0xFFFFFFFFLL;
  if (ids.size() > static_cast<std::size_t>(INT32_MAX))
    throw std::invalid_argument("[write_token_file] " + std::to_string(ids.size()) +
                                " tokens: the header's count is an int32");
  std::vector<unsigned char> bytes(
      static_cast<std::size_t>(kTokenHeaderWords * 4 + static_cast<int64_t>(ids.size()) * w));
  auto put = [&](std::size_t at, uint32_t v, int64_t nbytes) {
    for (int64_t k = 0; k < nbytes; ++k) bytes[at + std::size_t(k)] = (v >> (8 * k)) & 0xFF;
  };
  put(0, uint32_t(width == TokenWidth::u16 ? kTokenMagicU16 : kTokenMagicU32), 4);
  put(4, uint32_t(width == TokenWidth::u16 ? kTokenVersionU16 : kTokenVersionU32), 4);
  put(8, uint32_t(ids.size()), 4);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > most)
      throw std::invalid_argument("[write_token_file] id " + std::to_string(ids[i]) +
                                  " at position " + std::to_string(i) + " does not fit " +
                                  (width == TokenWidth::u16 ? "uint16" : "uint32"));
    put(std::size_t(kTokenHeaderWords * 4) + i * std::size_t(w), uint32_t(ids[i]), w);
  }
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error(tmp + ": cannot write: " + std::strerror(errno));
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error(path + ": cannot write the token file");
  }
}

}  // namespace quanta::llm
