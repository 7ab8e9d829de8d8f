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

/** A file written piece by piece and put in place whole: the pieces go to a
 * temporary file beside `path` (`path`.tmp.PID, locked while it is written);
 * commit() syncs it and renames it over `path`. Destroyed uncommitted (an
 * error while making the next piece), the temporary file is removed and
 * `path` is as it was. A temporary file of `path` that no live writer locks
 * (its process was killed) is removed when a writer of `path` starts (each
 * process lists a folder's temporary files once, at its first write there). For files larger than
 * memory, written as their parts are made. Errors as write_file_atomic's. */
class AtomicFileWriter {
 public:
  AtomicFileWriter(std::string path, const char* op);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(ByteSpan piece);
  /** Syncs, closes and renames the file over `path`, then syncs its folder. */
  void commit();

 private:
  std::string path_, tmp_;
  const char* op_;
  int fd_ = -1;
};

/** Writes `pieces` one after another to `path` atomically (see above).
 * Errors are std::runtime_error starting with "[op]" and naming the file;
 * the temporary file is removed. */
void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces,
                       const char* op);

/** write_file_atomic of one string (config files, JSON). */
void write_text_atomic(const std::string& path, const std::string& text, const char* op);

/** Puts folder `staged` (written whole beside it) in the place of folder
 * `dir` in one step, for folders whose files only make sense together (an
 * adapter folder's config and weights): a reader sees the old folder or the
 * new one. `dir` absent: a rename. `dir` present: the two are exchanged
 * (renameat2 RENAME_EXCHANGE) and the old contents, now at `staged`, are
 * removed. On a file system that cannot exchange, `staged`'s files replace
 * `dir`'s one by one, each atomically. Errors as write_file_atomic's. */
void replace_folder(const std::string& staged, const std::string& dir, const char* op);

}  // namespace quanta::io
