#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>
#include <tuple>

#include "engine/io/safetensors_spec.h"

namespace quanta::io {
namespace {

using safetensors_spec::find_spec;
using safetensors_spec::kBlockDTypeKey;
using safetensors_spec::quote_name;
using safetensors_spec::SpecDType;

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian values; quanta copies bytes as they are");

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The reference loader's limit on the header size.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string brief_json(const json& j) {
  std::string s = j.dump(-1, ' ', true, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 80) + "..." : s;
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw std::runtime_error("[safetensors] " + source + ": " + what);
}

// A file of another kind (or one some tool mangled) read as safetensors: the
// reference loader refuses these too, and saying so beats quoting a header
// length made of ASCII text.
[[noreturn]] void not_safetensors(const std::string& source, const std::string& why) {
  throw std::runtime_error("[safetensors] " + source + " is not a safetensors file (" + why + ")");
}

[[noreturn]] void fail_errno(const std::string& source, const std::string& what) {
  fail(source, what + ": " + std::strerror(errno));
}

// ---- header parsing ----

// Rejects duplicate keys (nlohmann keeps the last silently; the reference
// loader refuses them) and nesting deeper than the format has.
struct HeaderGuard {
  std::vector<std::set<std::string>> keys;  // one set per open object
  int depth = 0;
  std::optional<std::string> error;

  bool operator()(int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        [[fallthrough]];
      case json::parse_event_t::array_start:
        if (++depth > 3) {
          error = "header nests objects or arrays deeper than the format allows";
          throw std::runtime_error(*error);
        }
        break;
      case json::parse_event_t::object_end:
        keys.pop_back();
        [[fallthrough]];
      case json::parse_event_t::array_end:
        --depth;
        break;
      case json::parse_event_t::key:
        if (!keys.back().insert(parsed.get<std::string>()).second) {
          error = "duplicate key " + quote_name(parsed.get<std::string>()) + " in header" +
                  (keys.size() == 1 ? " (two tensors with one name)" : "");
          throw std::runtime_error(*error);
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  }
};

json parse_json(const char* text, uint64_t n, const std::string& source) {
  // nlohmann stops at a NUL byte as if the input ended there; JSON never holds
  // one, and the reference loader rejects it.
  if (const void* nul = std::memchr(text, '\0', n))
    fail(source, "header is not valid JSON (NUL byte at header offset " +
                     std::to_string(static_cast<const char*>(nul) - text) + ")");
  HeaderGuard guard;
  try {
    return json::parse(text, text + n, std::ref(guard));
  } catch (const json::exception& e) {
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    fail(source, "header is not valid JSON (" + what + ")");
  } catch (const std::runtime_error&) {
    if (!guard.error) throw;
    fail(source, *guard.error);
  }
}

uint64_t get_u64(const json& j) { return j.get<uint64_t>(); }

SafetensorsEntry parse_entry(const std::string& name, const json& info, const std::string& source) {
  const std::string who = "tensor " + quote_name(name);
  if (!info.is_object()) fail(source, who + ": header entry is not an object");
  SafetensorsEntry e;
  e.name = name;

  auto field = [&](const char* key) -> const json& {
    auto it = info.find(key);
    if (it == info.end()) fail(source, who + ": missing field '" + key + "'");
    return *it;
  };

  const json& dtype = field("dtype");
  if (!dtype.is_string())
    fail(source, who + ": field 'dtype' must be a string, got " + brief_json(dtype));
  e.dtype = dtype.get<std::string>();
  const SpecDType* spec = find_spec(e.dtype);
  if (!spec) fail(source, "unknown dtype " + quote_name(e.dtype) + " for " + who);

  const json& shape = field("shape");
  if (!shape.is_array())
    fail(source, who + ": field 'shape' must be a list, got " + brief_json(shape));
  // Elements times the bits of one element must fit; so must the product of
  // the non-zero sizes, which later stride arithmetic multiplies out.
  constexpr uint64_t kMaxI64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  for (const json& d : shape) {
    if (!d.is_number_unsigned())
      fail(source, who + ": shape must hold non-negative integers, got " + brief_json(shape));
    const uint64_t v = get_u64(d);
    if (v > kMaxI64) fail(source, who + ": shape " + brief_json(shape) + " overflows 64-bit sizes");
    e.shape.push_back(static_cast<int64_t>(v));
  }
  const auto numel = checked_numel(e.shape);
  const auto total_bits = numel ? checked_mul(*numel, spec->bits) : std::nullopt;
  if (!total_bits) fail(source, who + ": shape " + brief_json(shape) + " overflows 64-bit sizes");
  const auto bits = static_cast<uint64_t>(*total_bits);
  if (bits % 8 != 0)
    fail(source, who + ": " + std::to_string(*numel) + " elements of " + e.dtype +
                     " do not fill whole bytes");

  const json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    fail(source, who + ": field 'data_offsets' must be two non-negative integers, got " +
                     brief_json(offsets));
  e.begin = get_u64(offsets[0]);
  e.end = get_u64(offsets[1]);
  if (e.begin > e.end)
    fail(source, who + ": data_offsets " + brief_json(offsets) + " begin after they end");
  if (e.end - e.begin != bits / 8)
    fail(source, who + ": shape " + brief_json(shape) + " of " + e.dtype + " needs " +
                     std::to_string(bits / 8) + " bytes but data_offsets " + brief_json(offsets) +
                     " span " + std::to_string(e.end - e.begin));
  return e;
}

// Validates the header text against a byte buffer of `buffer_bytes`.
SafetensorsHeader parse_header(const char* text, uint64_t n, uint64_t buffer_bytes,
                               const std::string& source) {
  const json root = parse_json(text, n, source);
  if (!root.is_object()) fail(source, "header is not a JSON object");

  SafetensorsHeader h;
  h.header_bytes = n;
  h.data_bytes = buffer_bytes;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // the reference loader reads null as "none"
      if (!value.is_object())
        fail(source, "__metadata__ must be an object of strings, got " + brief_json(value));
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string())
          fail(source, "__metadata__ value for key " + quote_name(k) +
                           " is not a string: " + brief_json(v));
        h.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(key, value, source));
  }

  // The reference loader requires the tensors to tile the buffer: no holes,
  // no overlaps, no trailing bytes. Header order is free, so sort by offsets.
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  uint64_t cursor = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : h.tensors) {
    if (e.end > buffer_bytes)
      fail(source, "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                       "] of tensor " + quote_name(e.name) + " lie outside the " +
                       std::to_string(buffer_bytes) + "-byte data buffer (truncated file?)");
    if (e.begin < cursor)
      fail(source, "tensors " + quote_name(prev->name) + " and " + quote_name(e.name) +
                       " overlap in the data buffer");
    if (e.begin > cursor)
      fail(source, "the data buffer has a " + std::to_string(e.begin - cursor) +
                       "-byte hole before tensor " + quote_name(e.name) +
                       " (tensors must cover the buffer exactly)");
    cursor = e.end;
    prev = &e;
  }
  if (cursor != buffer_bytes)
    fail(source, "the data buffer has " + std::to_string(buffer_bytes - cursor) +
                     " bytes after the last tensor (tensors must cover it exactly)");
  return h;
}

// The first byte of a header, as an error message shows it.
std::string byte_text(uint8_t c) {
  if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02X", c);
  return std::string("byte ") + buf;
}

// How many bytes of a file check_length looks at: the length and the first
// three bytes of the header (room for a UTF-8 byte order mark).
constexpr uint64_t kHeadBytes = 11;

// Checks the 8-byte length against the total size and the start of the
// header, given the first min(total, kHeadBytes) bytes; returns N.
uint64_t check_length(const uint8_t* head, uint64_t total, const std::string& source) {
  if (total < 8)
    not_safetensors(
        source, "it is " + std::to_string(total) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, head, 8);
  if (n > kMaxHeaderBytes)
    not_safetensors(source, "header length " + std::to_string(n) + " exceeds the " +
                                std::to_string(kMaxHeaderBytes) + "-byte limit");
  // The reference loader wants the JSON to start with '{'. nlohmann would
  // skip a byte order mark silently; a writer that adds one is broken.
  const uint64_t seen = std::min({n, total - 8, kHeadBytes - 8});
  const uint8_t* text = head + 8;
  if (seen >= 3 && text[0] == 0xEF && text[1] == 0xBB && text[2] == 0xBF)
    not_safetensors(source,
                    "the header starts with a UTF-8 byte order mark (EF BB BF); "
                    "its JSON must start with '{'");
  if (seen >= 1 && text[0] != '{')
    not_safetensors(source, "the header is not a JSON object: it starts with " +
                                byte_text(text[0]) + ", not '{'");
  if (n > total - 8)
    fail(source, "header length " + std::to_string(n) + " exceeds the " +
                     std::to_string(total - 8) + " bytes after it (truncated file?)");
  return n;
}

std::pair<DType, Shape> parse_block_dtype(const std::string& value, const SafetensorsEntry& e,
                                          const std::string& source) {
  const auto space = value.find(' ');
  DType dt;
  Shape shape;
  try {
    dt = parse_dtype(value.substr(0, space));
    shape =
        json::parse(value.substr(space == std::string::npos ? value.size() : space)).get<Shape>();
  } catch (const std::exception&) {
    fail(source, "metadata " + quote_name(kBlockDTypeKey + e.name) +
                     " is not '<dtype> [shape]': " + quote_name(value));
  }
  const std::string key = quote_name(kBlockDTypeKey + e.name);
  const auto& info = dtype_info(dt);
  for (int64_t d : shape)
    if (d < 0) fail(source, "metadata " + key + " has a negative size");
  // The shape comes from the file: a product that wraps would give a tensor
  // with a negative or tiny element count over a few bytes.
  const auto bytes = detail::storage_bytes(shape, dt);
  if (!bytes)
    fail(source, "tensor " + quote_name(e.name) + ": metadata " + key + " gives shape " +
                     shape_str(shape) + ", which overflows 64-bit sizes");
  if (info.block_elems == 1 || e.dtype != "U8" || e.shape.size() != 1 ||
      e.end - e.begin != static_cast<uint64_t>(*bytes))
    fail(source, "tensor " + quote_name(e.name) + " stored as " + e.dtype + " " +
                     std::to_string(e.end - e.begin) + " bytes does not hold " + value);
  return {dt, shape};
}

// A tensor of a validated header as quanta loads it: its dtype and shape
// (a byte-only dtype's from the metadata) and where its bytes lie.
struct PlannedTensor {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// Every tensor of a validated header, in buffer order; the block-dtype keys
// are taken out of its metadata. Throws for a dtype quanta cannot load.
std::vector<PlannedTensor> plan_tensors(SafetensorsHeader& h, const std::string& source) {
  for (const auto& e : h.tensors)
    if (!find_spec(e.dtype)->dtype)
      fail(source, "unsupported dtype " + e.dtype + " for tensor " + quote_name(e.name) +
                       " (quanta loads F64 F32 F16 BF16 I64 I32 U8 BOOL)");
  std::vector<PlannedTensor> out;
  out.reserve(h.tensors.size());
  for (const auto& e : h.tensors) {
    PlannedTensor p{e.name, *find_spec(e.dtype)->dtype, e.shape, e.begin, e.end};
    // A byte-only dtype travels as U8 bytes; metadata gives its dtype and shape.
    if (auto it = h.metadata.find(kBlockDTypeKey + e.name); it != h.metadata.end()) {
      std::tie(p.dtype, p.shape) = parse_block_dtype(it->second, e, source);
      h.metadata.erase(it);
    }
    out.push_back(std::move(p));
  }
  return out;
}

// One planned tensor on the host; `read(offset, dst, n)` copies n bytes of
// the data buffer starting at `offset`.
Tensor read_planned(const PlannedTensor& p,
                    const std::function<void(uint64_t, void*, uint64_t)>& read) {
  Tensor t = detail::make_tensor(p.shape, p.dtype, Device::cpu());
  const uint64_t n = p.end - p.begin;
  if (n > 0) {
    read(p.begin, t.raw_data(), n);
    if (p.dtype == DType::boolean) {
      // Any non-zero byte is true (as NumPy reads it); a C++ bool must be 0 or 1.
      auto* b = static_cast<uint8_t*>(t.raw_data());
      for (uint64_t i = 0; i < n; ++i) b[i] = b[i] != 0;
    }
  }
  return t;
}

// Builds the tensors of a validated header, sorted by name.
SafetensorsFile build_tensors(SafetensorsHeader&& h, const std::string& source,
                              const std::function<void(uint64_t, void*, uint64_t)>& read) {
  const std::vector<PlannedTensor> planned = plan_tensors(h, source);
  SafetensorsFile f;
  f.metadata = std::move(h.metadata);
  f.tensors.reserve(planned.size());
  for (const PlannedTensor& p : planned) f.tensors.emplace_back(p.name, read_planned(p, read));
  std::sort(f.tensors.begin(), f.tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return f;
}

// ---- files ----

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  /** Closes now; returns close()'s result (writers must check it). */
  int reset() {
    int rc = 0;
    if (fd_ >= 0) rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// An open file being read, with its size.
struct InputFile {
  Fd fd;
  uint64_t size = 0;

  // O_NONBLOCK: opening a FIFO for reading would wait for a writer, so the
  // check below that refuses it would never run. pread ignores the flag on
  // the regular files that pass.
  explicit InputFile(const std::string& path)
      : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)) {
    if (fd.get() < 0) fail_errno(path, "cannot open");
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail_errno(path, "cannot stat");
    if (S_ISDIR(st.st_mode)) fail(path, "is a directory, not a safetensors file");
    if (!S_ISREG(st.st_mode)) fail(path, "is not a regular file");
    size = static_cast<uint64_t>(st.st_size);
  }

  void read_at(uint64_t offset, void* dst, uint64_t n, const std::string& path) const {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      const std::size_t chunk = static_cast<std::size_t>(std::min<uint64_t>(n, 1u << 30));
      const ssize_t got = ::pread(fd.get(), p, chunk, static_cast<off_t>(offset));
      if (got < 0) {
        if (errno == EINTR) continue;
        fail_errno(path, "read failed");
      }
      if (got == 0) fail(path, "file ended early (was it changed while being read?)");
      p += got;
      offset += static_cast<uint64_t>(got);
      n -= static_cast<uint64_t>(got);
    }
  }
};

SafetensorsHeader read_header(const InputFile& in, const std::string& path) {
  std::array<uint8_t, kHeadBytes> head{};
  in.read_at(0, head.data(), std::min<uint64_t>(in.size, kHeadBytes), path);
  const uint64_t n = check_length(head.data(), in.size, path);
  std::string text(n, '\0');
  in.read_at(8, text.data(), n, path);
  return parse_header(text.data(), n, in.size - 8 - n, path);
}

}  // namespace

// ---- public API ----

SafetensorsHeader read_safetensors_header(const std::string& path) {
  InputFile in(path);
  return read_header(in, path);
}

SafetensorsFile load_safetensors(const std::string& path) {
  InputFile in(path);
  SafetensorsHeader h = read_header(in, path);
  const uint64_t base = 8 + h.header_bytes;
  return build_tensors(std::move(h), path, [&](uint64_t off, void* dst, uint64_t n) {
    in.read_at(base + off, dst, n, path);
  });
}

std::vector<uint8_t> read_safetensors_bytes(const std::string& path, const SafetensorsHeader& h,
                                            const SafetensorsEntry& e) {
  InputFile in(path);
  const uint64_t n = e.end - e.begin;
  if (in.size < 8 + h.header_bytes + e.end)
    fail(path, "tensor " + quote_name(e.name) +
                   " lies past the end of the file (was it "
                   "changed after its header was read?)");
  std::vector<uint8_t> out(n);
  if (n > 0) in.read_at(8 + h.header_bytes + e.begin, out.data(), n, path);
  return out;
}

struct SafetensorsReader::State {
  std::string path;
  InputFile in;
  uint64_t base = 0;  // where the byte buffer starts
  std::map<std::string, PlannedTensor> tensors;
  std::map<std::string, std::string> metadata;
  explicit State(const std::string& p) : path(p), in(p) {}
};

SafetensorsReader::SafetensorsReader(const std::string& path)
    : state_(std::make_unique<State>(path)) {
  SafetensorsHeader h = read_header(state_->in, path);
  state_->base = 8 + h.header_bytes;
  for (PlannedTensor& p : plan_tensors(h, path)) state_->tensors.emplace(p.name, std::move(p));
  state_->metadata = std::move(h.metadata);
}

SafetensorsReader::~SafetensorsReader() = default;
SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&&) noexcept = default;

const std::string& SafetensorsReader::path() const { return state_->path; }

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(state_->tensors.size());
  for (const auto& [name, p] : state_->tensors) out.push_back(name);
  return out;
}

bool SafetensorsReader::contains(const std::string& name) const {
  return state_->tensors.count(name) > 0;
}

namespace {
const PlannedTensor& planned_of(const std::map<std::string, PlannedTensor>& tensors,
                                const std::string& name, const std::string& path) {
  const auto it = tensors.find(name);
  if (it == tensors.end()) fail(path, "holds no tensor " + quote_name(name));
  return it->second;
}
}  // namespace

DType SafetensorsReader::dtype(const std::string& name) const {
  return planned_of(state_->tensors, name, state_->path).dtype;
}

const Shape& SafetensorsReader::shape(const std::string& name) const {
  return planned_of(state_->tensors, name, state_->path).shape;
}

Tensor SafetensorsReader::read(const std::string& name) const {
  const PlannedTensor& p = planned_of(state_->tensors, name, state_->path);
  const State& st = *state_;
  return read_planned(p, [&](uint64_t off, void* dst, uint64_t n) {
    st.in.read_at(st.base + off, dst, n, st.path);
  });
}

const std::map<std::string, std::string>& SafetensorsReader::metadata() const {
  return state_->metadata;
}

SafetensorsFile parse_safetensors(const std::vector<uint8_t>& bytes, const std::string& source) {
  const uint64_t n = check_length(bytes.data(), bytes.size(), source);
  const char* text = reinterpret_cast<const char*>(bytes.data()) + 8;
  SafetensorsHeader h = parse_header(text, n, bytes.size() - 8 - n, source);
  const uint8_t* base = bytes.data() + 8 + n;
  return build_tensors(std::move(h), source, [&](uint64_t off, void* dst, uint64_t len) {
    std::memcpy(dst, base + off, len);
  });
}

}  // namespace quanta::io
