#include <filesystem>
#include <stdexcept>

#include "engine/io/safetensors.h"
#include "quant/parity/parity.h"

namespace quanta::parity {

const Tensor& CaseFile::at(const std::string& key) const {
  auto it = tensors.find(key);
  if (it == tensors.end())
    throw std::runtime_error(path + ": the case has no tensor '" + key + "'");
  return it->second;
}

const std::string& CaseFile::meta(const std::string& key) const {
  auto it = metadata.find(key);
  if (it == metadata.end())
    throw std::runtime_error(path + ": the case metadata has no key '" + key + "'");
  return it->second;
}

CaseFile load_case(const std::string& path) {
  io::SafetensorsFile f = io::load_safetensors(path);
  CaseFile c;
  c.path = path;
  c.metadata = std::move(f.metadata);
  for (auto& [name, t] : f.tensors) c.tensors.emplace(name, std::move(t));
  auto it = c.metadata.find("case");
  c.name = it != c.metadata.end() ? it->second : std::filesystem::path(path).stem().string();
  return c;
}

}  // namespace quanta::parity
