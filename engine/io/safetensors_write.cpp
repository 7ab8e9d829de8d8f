// Writing safetensors files: the header laid out as the reference writer
// lays it out (largest alignment first, then by name), then each tensor's
// bytes; everything that can be refused is refused before the disk is
// touched.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
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

// What a file holds, in write order: the padded header, then each tensor's bytes.
struct Prepared {
  std::string header;
  std::vector<Tensor> data;  // contiguous CPU tensors in buffer order
};

Prepared prepare(const TensorMap& tensors, const std::map<std::string, std::string>& metadata) {
  struct Item {
    const std::string* name;
    Tensor t;
    const SpecDType* spec;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  std::map<std::string, std::string> meta = metadata;
  std::set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__")
      throw std::invalid_argument(
          "[save_safetensors] tensor name '__metadata__' is reserved for file metadata");
    if (!seen.insert(name).second)
      throw std::invalid_argument("[save_safetensors] duplicate tensor name " + quote_name(name));
    if (!t.defined())
      throw std::invalid_argument("[save_safetensors] tensor " + quote_name(name) +
                                  " is undefined");
    if (dtype_info(t.dtype()).block_elems != 1) {
      // Block dtypes (nf4) are saved as their bytes, U8 [nbytes].
      const Tensor c = t.detach().to(Device::cpu()).contiguous();
      Tensor bytes =
          detail::make_tensor({static_cast<int64_t>(c.nbytes())}, DType::u8, Device::cpu());
      if (c.nbytes()) std::memcpy(bytes.raw_data(), c.raw_data(), c.nbytes());
      meta[kBlockDTypeKey + name] =
          std::string(dtype_name(t.dtype())) + " " + json(t.shape()).dump();
      items.push_back({&name, bytes, find_spec(DType::u8)});
      continue;
    }
    const SpecDType* spec = find_spec(t.dtype());
    if (!spec)
      throw std::invalid_argument("[save_safetensors] tensor " + quote_name(name) + " has dtype " +
                                  dtype_name(t.dtype()) +
                                  ", which safetensors files cannot hold yet");
    items.push_back({&name, t.detach().to(Device::cpu()).contiguous(), spec});
  }
  // Like the reference writer: largest alignment first, then by name, so every
  // tensor starts at a multiple of its element size (the header is padded to 8).
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.spec->rank != b.spec->rank) return a.spec->rank > b.spec->rank;
    return *a.name < *b.name;
  });

  ordered_json header = ordered_json::object();
  if (!meta.empty()) header["__metadata__"] = meta;
  Prepared p;
  uint64_t offset = 0;
  for (auto& item : items) {
    const uint64_t n = item.t.nbytes();
    ordered_json info = ordered_json::object();
    info["dtype"] = item.spec->name;
    info["shape"] = item.t.shape();
    info["data_offsets"] = {offset, offset + n};
    header[*item.name] = std::move(info);
    offset += n;
    p.data.push_back(std::move(item.t));
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

}  // namespace

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Everything that can be refused is refused before touching the disk.
  const Prepared p = prepare(tensors, metadata);
  const uint64_t n = p.header.size();
  std::vector<ByteSpan> pieces = {{&n, 8}, {p.header.data(), n}};
  for (const Tensor& t : p.data) pieces.push_back({t.raw_data(), t.nbytes()});
  write_file_atomic(path, pieces, "save_safetensors");
}

std::vector<uint8_t> serialize_safetensors(const TensorMap& tensors,
                                           const std::map<std::string, std::string>& metadata) {
  const Prepared p = prepare(tensors, metadata);
  uint64_t total = 8 + p.header.size();
  for (const Tensor& t : p.data) total += t.nbytes();
  // Sized once and filled with memcpy (GCC 12 misreports vector::insert here).
  std::vector<uint8_t> out(total);
  uint8_t* dst = out.data();
  const uint64_t n = p.header.size();
  std::memcpy(dst, &n, 8);
  std::memcpy(dst + 8, p.header.data(), n);
  dst += 8 + n;
  for (const Tensor& t : p.data) {
    if (t.nbytes() > 0) std::memcpy(dst, t.raw_data(), t.nbytes());
    dst += t.nbytes();
  }
  return out;
}

}  // namespace quanta::io
