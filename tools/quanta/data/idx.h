#pragma once
// IDX files (the MNIST / Fashion-MNIST container), gzipped or plain:
// two zero bytes, a type byte, the number of dims, then each dim as a
// big-endian u32, then the elements row-major. Only unsigned bytes (type 0x08)
// are read: it is what image and label files hold.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::data {

/** A whole IDX file of unsigned bytes: its dims and its elements. */
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

/** Reads `path` (gzip-compressed or not) and validates magic, dims and size:
 * the element count must match the dims exactly. Throws std::runtime_error
 * naming the file and what is wrong (missing, not IDX, truncated, corrupt
 * compression, trailing bytes, unsupported type).
 *
 * With `max_rows` >= 0 only the first min(max_rows, dims[0]) entries of dim 0
 * are read into data (dims stay the header's) and the file after them is
 * neither read nor checked: a run on 64 images of a large file inflates
 * those, not the whole file. */
IdxArray read_idx(const std::string& path, int64_t max_rows = -1);

/** The bytes of an IDX file holding `a` (uncompressed), for tests and tools. */
std::vector<uint8_t> idx_bytes(const IdxArray& a);

}  // namespace quanta::data
