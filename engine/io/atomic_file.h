#pragma once
// Files written whole or not at all: a temporary file in the same folder,
// fsync, rename over the target, fsync of the folder. A reader never sees a
// torn file, and a failure leaves the old file as it was.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::io {

/** A run of bytes to write (not owned). */
struct ByteSpan {
  const void* data = nullptr;
  uint64_t size = 0;
};

/** Writes `pieces` one after another to `path` atomically (see above).
 * Errors are std::runtime_error starting with "[op]" and naming the file;
 * the temporary file is removed. */
void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces,
                       const char* op);

/** write_file_atomic of one string (config files, JSON). */
void write_text_atomic(const std::string& path, const std::string& text, const char* op);

}  // namespace quanta::io
