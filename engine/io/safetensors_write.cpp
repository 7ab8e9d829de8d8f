// Writing safetensors files: the header laid out as the reference writer
// lays it out (largest alignment first, then by name), then each tensor's
// bytes, each tensor made, copied to the host and written before the next;
// everything the names, dtypes and shapes can refuse is refused before the
// disk is touched.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>

#include "engine/factory.h"
#include "engine/io/atomic_file.h"
#include "engine/io/safetensors.h"
#include "engine/io/safetensors_spec.h"

namespace quanta::io {
namespace {

using safetensors_spec::find_spec;
using safetensors_spec::kBlockDTypeKey;
using safetensors_spec::quote_name;
using safetensors_spec::SpecDType;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// One tensor as the file stores it: its spec dtype and bytes (a block
// dtype's as U8 [nbytes], its own dtype and shape in the metadata).
struct Planned {
  const TensorSource* source;
  const SpecDType* spec;
  Shape stored_shape;
  uint64_t nbytes;
};

// What a file holds, in write order: the padded header, then each tensor.
struct Plan {
  std::string header;
  std::vector<Planned> tensors;
  uint64_t data_bytes = 0;
};

bool is_block_dtype(DType t) { return dtype_info(t).block_elems != 1; }

// Everything that can be refused from the names, dtypes and shapes alone is
// refused here, before a tensor is made or the disk touched.
Plan plan(const std::vector<TensorSource>& sources,
          const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> meta = metadata;
  std::set<std::string_view> seen;
  Plan p;
  p.tensors.reserve(sources.size());
  for (const TensorSource& src : sources) {
    const std::string& name = src.name;
    if (name == "__metadata__")
      throw std::invalid_argument(
          "[save_safetensors] tensor name '__metadata__' is reserved for file metadata");
    if (!seen.insert(name).second)
      throw std::invalid_argument("[save_safetensors] duplicate tensor name " + quote_name(name));
    const std::optional<int64_t> bytes = quanta::detail::storage_bytes(src.shape, src.dtype);
    if (!bytes)
      throw std::invalid_argument("[save_safetensors] tensor " + quote_name(name) + " has shape " +
                                  shape_str(src.shape) + ", which has no size");
    if (is_block_dtype(src.dtype)) {
      meta[kBlockDTypeKey + name] =
          std::string(dtype_name(src.dtype)) + " " + json(src.shape).dump();
      p.tensors.push_back({&src, find_spec(DType::u8), {*bytes}, static_cast<uint64_t>(*bytes)});
      continue;
    }
    const SpecDType* spec = find_spec(src.dtype);
    if (!spec)
      throw std::invalid_argument("[save_safetensors] tensor " + quote_name(name) + " has dtype " +
                                  dtype_name(src.dtype) +
                                  ", which safetensors files cannot hold yet");
    p.tensors.push_back({&src, spec, src.shape, static_cast<uint64_t>(*bytes)});
  }
  // Like the reference writer: largest alignment first, then by name, so every
  // tensor starts at a multiple of its element size (the header is padded to 8).
  std::sort(p.tensors.begin(), p.tensors.end(), [](const Planned& a, const Planned& b) {
    if (a.spec->rank != b.spec->rank) return a.spec->rank > b.spec->rank;
    return a.source->name < b.source->name;
  });

  ordered_json header = ordered_json::object();
  if (!meta.empty()) header["__metadata__"] = meta;
  for (const Planned& t : p.tensors) {
    ordered_json info = ordered_json::object();
    info["dtype"] = t.spec->name;
    info["shape"] = t.stored_shape;
    info["data_offsets"] = {p.data_bytes, p.data_bytes + t.nbytes};
    header[t.source->name] = std::move(info);
    p.data_bytes += t.nbytes;
  }
  try {
    p.header = header.dump();
  } catch (const ordered_json::exception& e) {
    throw std::invalid_argument(std::string("[save_safetensors] a tensor name or metadata "
                                            "string is not valid UTF-8 (") +
                                e.what() + ")");
  }
  p.header.append((8 - p.header.size() % 8) % 8, ' ');
  return p;
}

// Makes planned tensor `t` and gives its bytes as the file stores them: on
// the host, contiguous, a block dtype's storage as it is.
Tensor stored_bytes(const Planned& t) {
  const TensorSource& src = *t.source;
  const Tensor made = src.make ? src.make() : Tensor();
  if (!made.defined())
    throw std::invalid_argument("[save_safetensors] tensor " + quote_name(src.name) +
                                " is undefined");
  if (made.dtype() != src.dtype || made.shape() != src.shape)
    throw std::runtime_error("[save_safetensors] tensor " + quote_name(src.name) + " was made as " +
                             dtype_name(made.dtype()) + " " + shape_str(made.shape()) +
                             ", not the " + dtype_name(src.dtype) + " " + shape_str(src.shape) +
                             " its header entry says");
  return made.detach().to(Device::cpu()).contiguous();
}

}  // namespace

std::vector<TensorSource> tensor_sources(const TensorMap& tensors) {
  std::vector<TensorSource> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw std::invalid_argument("[save_safetensors] tensor " + quote_name(name) +
                                  " is undefined");
    out.push_back({name, t.dtype(), t.shape(), [t = t] { return t; }});
  }
  return out;
}

std::unique_ptr<AtomicFileWriter> stage_safetensors(
    const std::string& path, const std::vector<TensorSource>& sources,
    const std::map<std::string, std::string>& metadata) {
  const Plan p = plan(sources, metadata);
  auto file = std::make_unique<AtomicFileWriter>(path, "save_safetensors");
  const uint64_t n = p.header.size();
  file->write({&n, 8});
  file->write({p.header.data(), n});
  for (const Planned& t : p.tensors) {
    const Tensor bytes = stored_bytes(t);
    file->write({bytes.raw_data(), bytes.nbytes()});
  }
  return file;
}

void check_safetensors_sources(const std::vector<TensorSource>& sources,
                               const std::map<std::string, std::string>& metadata) {
  plan(sources, metadata);
}

void save_safetensors_streamed(const std::string& path, const std::vector<TensorSource>& sources,
                               const std::map<std::string, std::string>& metadata) {
  stage_safetensors(path, sources, metadata)->commit();
}

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  save_safetensors_streamed(path, tensor_sources(tensors), metadata);
}

std::vector<uint8_t> serialize_safetensors(const TensorMap& tensors,
                                           const std::map<std::string, std::string>& metadata) {
  const std::vector<TensorSource> sources = tensor_sources(tensors);
  const Plan p = plan(sources, metadata);
  // Sized once and filled with memcpy (GCC 12 misreports vector::insert here).
  std::vector<uint8_t> out(8 + p.header.size() + p.data_bytes);
  uint8_t* dst = out.data();
  const uint64_t n = p.header.size();
  std::memcpy(dst, &n, 8);
  std::memcpy(dst + 8, p.header.data(), n);
  dst += 8 + n;
  for (const Planned& t : p.tensors) {
    const Tensor bytes = stored_bytes(t);
    if (bytes.nbytes() > 0) std::memcpy(dst, bytes.raw_data(), bytes.nbytes());
    dst += bytes.nbytes();
  }
  return out;
}

}  // namespace quanta::io
