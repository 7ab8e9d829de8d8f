// Gzipped IDX reading through zlib's gz* stream, which also passes plain
// files through unchanged.
#include "data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <new>
#include <stdexcept>

namespace quanta::data {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;
// Fashion-MNIST has 60000 x 28 x 28; refuse headers that claim absurd sizes
// before allocating (a corrupt header must not become a bad_alloc).
constexpr uint64_t kMaxElements = uint64_t{1} << 34;
// The data is read in pieces of this size (see read_idx).
constexpr uint64_t kChunk = uint64_t{64} << 20;

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

// Reads exactly `n` bytes or fails saying what was being read. `before` of
// `total` bytes of the same part came before (the data is read in chunks).
void read_exact(gzFile f, const std::string& path, uint8_t* out, uint64_t n, const char* what,
                uint64_t before = 0, uint64_t total = 0) {
  uint64_t got = 0;
  while (got < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<uint64_t>(n - got, 1u << 30));
    const int r = gzread(f, out + got, chunk);
    if (r < 0) {
      int err = 0;
      const char* msg = gzerror(f, &err);
      fail(path, std::string("corrupt gzip data while reading the ") + what + " (" +
                     (msg ? msg : "zlib error") + ")");
    }
    if (r == 0) {
      fail(path, std::string("truncated: the ") + what + " needs " +
                     std::to_string(total ? total : n) + " bytes, the file holds " +
                     std::to_string(before + got));
    }
    got += static_cast<uint64_t>(r);
  }
}

// Refuses a header that declares more data than the file can hold, before
// anything is allocated: a plain file must hold exactly `count` bytes after
// the header; deflate cannot expand a byte into more than 1032, so a gzip
// file of S bytes holds at most 1032 S.
void check_size(const std::string& path, gzFile f, uint64_t header, uint64_t count) {
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) return;  // not a regular file: the reads will tell
  const bool plain = gzdirect(f) == 1;
  const uint64_t room = plain ? (size > header ? size - header : 0) : size * 1032;
  if (count > room)
    fail(path,
         "truncated: the IDX header declares " + std::to_string(count) + " bytes of data, " +
             (plain ? "the file holds " + std::to_string(room) + " after the header"
                    : "more than a gzip file of " + std::to_string(size) + " bytes can hold"));
}

}  // namespace

IdxArray read_idx(const std::string& path, int64_t max_rows) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(path, "cannot open: no such file");
  if (std::filesystem::is_directory(path, ec)) fail(path, "cannot open: is a directory");
  GzHandle f(gzopen(path.c_str(), "rb"));
  if (!f) fail(path, "cannot open");

  uint8_t head[4];
  read_exact(f.get(), path, head, 4, "IDX header");
  if (head[0] != 0 || head[1] != 0)
    fail(path, "not an IDX file (the magic number must start with two zero bytes)");
  if (head[2] != kUnsignedByte)
    fail(path, "unsupported IDX element type 0x" +
                   std::string(1, "0123456789abcdef"[head[2] >> 4]) +
                   std::string(1, "0123456789abcdef"[head[2] & 15]) +
                   " (only unsigned bytes, 0x08, are read)");
  const int ndim = head[3];
  if (ndim == 0) fail(path, "IDX header declares 0 dimensions");

  IdxArray a;
  uint64_t count = 1;
  for (int d = 0; d < ndim; ++d) {
    uint8_t b[4];
    read_exact(f.get(), path, b, 4, "IDX dimension sizes");
    const uint64_t n =
        (uint64_t{b[0]} << 24) | (uint64_t{b[1]} << 16) | (uint64_t{b[2]} << 8) | uint64_t{b[3]};
    a.dims.push_back(static_cast<int64_t>(n));
    count *= n;
    if (count > kMaxElements) fail(path, "IDX dimensions claim more than 2^34 elements");
  }
  check_size(path, f.get(), 4 + 4 * uint64_t(ndim), count);
  // The rows asked for: all, or the first max_rows entries of dim 0.
  const uint64_t rows = static_cast<uint64_t>(a.dims[0]);
  const uint64_t wanted = max_rows < 0 || static_cast<uint64_t>(max_rows) >= rows
                              ? count
                              : (rows == 0 ? 0 : count / rows * static_cast<uint64_t>(max_rows));
  // Read in chunks, the buffer growing with what arrives: a header that
  // overstates a gzip file's content fails at its end, not in an allocation
  // of the size it claims.
  try {
    for (uint64_t got = 0; got < wanted;) {
      const uint64_t chunk = std::min<uint64_t>(wanted - got, kChunk);
      a.data.resize(got + chunk);
      read_exact(f.get(), path, a.data.data() + got, chunk, "IDX data", got, count);
      got += chunk;
    }
  } catch (const std::bad_alloc&) {
    fail(path, "out of memory for the " + std::to_string(wanted) +
                   " bytes of IDX data its header declares");
  }
  if (wanted < count) return a;  // the rest is not read, so not checked either
  uint8_t extra;
  const int r = gzread(f.get(), &extra, 1);
  if (r < 0) fail(path, "corrupt gzip data after the IDX data");
  if (r > 0)
    fail(path, "trailing bytes after the " + std::to_string(count) +
                   " elements the IDX dimensions declare");
  return a;
}

std::vector<uint8_t> idx_bytes(const IdxArray& a) {
  std::vector<uint8_t> out = {0, 0, kUnsignedByte, static_cast<uint8_t>(a.dims.size())};
  for (int64_t d : a.dims)
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(d >> s));
  out.insert(out.end(), a.data.begin(), a.data.end());
  return out;
}

}  // namespace quanta::data
