#pragma once
// safetensors checkpoints, readable and writable by the Python `safetensors`
// package. Layout: 8-byte little-endian u64 N, N bytes of JSON header
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}, then the byte buffer the offsets point
// into. Loading validates like the reference loader (it rejects holes, overlaps
// and trailing bytes: the tensors must tile the buffer exactly) and reports
// every problem as an error naming the file, never as a crash.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/io/atomic_file.h"
#include "engine/tensor.h"

namespace quanta::io {

/** Named tensors in a fixed order. */
using TensorMap = std::vector<std::pair<std::string, Tensor>>;

/** Everything a safetensors file holds: its tensors (sorted by name, as Python's
 * `safe_open(...).keys()` lists them) and its string metadata. */
struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;
};

/** One tensor as the header describes it; `dtype` is the spec's name ("F32",
 * "I8", ...), which may be a dtype quanta cannot load. Offsets are relative to
 * the start of the byte buffer. */
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

/** A validated header: entries in buffer order, metadata, and the sizes of the
 * header (N) and of the byte buffer. */
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t header_bytes = 0;
  uint64_t data_bytes = 0;
};

/** Writes `tensors` and `metadata` to `path` atomically: a temporary file in the
 * same folder, fsync, rename over `path`, fsync of the folder. On failure `path`
 * is left as it was and the temporary file is removed. Tensors are copied to the
 * CPU and made contiguous one at a time as they are written; names must be
 * unique and not "__metadata__". */
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/** A tensor to write that is made only when its turn comes: its name, dtype
 * and shape (what the header says) are known up front, its values made by
 * `make`. */
struct TensorSource {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::function<Tensor()> make;
};

/** Sources that give `tensors` as they are (already made). */
std::vector<TensorSource> tensor_sources(const TensorMap& tensors);

/** save_safetensors of tensors made one at a time: the header from the
 * sources' names, dtypes and shapes (refused as save_safetensors refuses them
 * before anything is made), then each tensor made in the file's order,
 * copied to the host, written and let go before the next is made, so that
 * peak memory is one tensor, not the file (a merged model larger than the
 * host's memory or the device's). A tensor made with another dtype or shape
 * than its source says is an error naming it; on any error `path` is left as
 * it was. */
void save_safetensors_streamed(const std::string& path, const std::vector<TensorSource>& sources,
                               const std::map<std::string, std::string>& metadata = {});

/** save_safetensors_streamed up to the last step: every tensor written to
 * the returned writer's temporary file beside `path`, which is not yet in
 * place (commit() puts it there; dropping the writer removes it). For a
 * set of files that should change together: all are made before any is
 * committed. */
std::unique_ptr<AtomicFileWriter> stage_safetensors(
    const std::string& path, const std::vector<TensorSource>& sources,
    const std::map<std::string, std::string>& metadata = {});

/** What save_safetensors_streamed refuses from the sources alone (a
 * duplicate or reserved name, a dtype safetensors cannot hold, a shape
 * without a size, text that is not UTF-8), refused now: for sources a caller
 * splits over several files. */
void check_safetensors_sources(const std::vector<TensorSource>& sources,
                               const std::map<std::string, std::string>& metadata = {});

/** Reads and validates a whole safetensors file; throws std::runtime_error
 * naming `path` and the problem ("PATH is not a safetensors file (...)" when
 * the header length is implausible or the header does not start with '{'). */
SafetensorsFile load_safetensors(const std::string& path);

/** Reads and validates only the header of `path` (no tensor data is read), for
 * listing files whose dtypes quanta cannot load. */
SafetensorsHeader read_safetensors_header(const std::string& path);

/** The stored bytes of one tensor `e` of the header `h` read from `path`,
 * without reading the others (small entries, such as bitsandbytes' JSON
 * state, for listings). */
std::vector<uint8_t> read_safetensors_bytes(const std::string& path, const SafetensorsHeader& h,
                                            const SafetensorsEntry& e);

/** A safetensors file opened to read its tensors one at a time: the header is
 * read and validated when it opens (as load_safetensors validates it, dtypes
 * included), each tensor's bytes only when read. For weights larger than
 * memory: a loader reads a layer, converts it and lets it go. The file stays
 * open until the reader is destroyed. */
class SafetensorsReader {
 public:
  /** Throws std::runtime_error naming `path` and the problem, as
   * load_safetensors does. */
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;

  const std::string& path() const;
  /** The tensors' names, sorted (as load_safetensors orders them). */
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /** A tensor's dtype and shape as load_safetensors gives them (a block
   * dtype's from the metadata). Throw for a name the file does not hold. */
  DType dtype(const std::string& name) const;
  const Shape& shape(const std::string& name) const;
  /** Reads one tensor, on the host (the same tensor load_safetensors gives). */
  Tensor read(const std::string& name) const;
  /** The string metadata, without the block-dtype keys. */
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/** The bytes save_safetensors would write, in memory. */
std::vector<uint8_t> serialize_safetensors(const TensorMap& tensors,
                                           const std::map<std::string, std::string>& metadata = {});

/** Parses safetensors bytes held in memory; errors name `source`. */
SafetensorsFile parse_safetensors(const std::vector<uint8_t>& bytes,
                                  const std::string& source = "<memory>");

}  // namespace quanta::io
