#pragma once
// The mutations of the input-fuzz drivers (model folders, adapter folders):
// files read and written whole, a JSON value replaced by a hostile one,
// bytes changed, cut or doubled, a bit of a safetensors header flipped.
// Each draws from `rng` in a fixed order, so a seed gives the same inputs.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace quanta::testing {

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

/** One top-level value of the JSON object in `path` (or, for an object
 * value, one of its members) replaced by one of `hostile`. */
inline void replace_json_value(const std::string& path, std::mt19937_64& rng,
                               const std::vector<nlohmann::json>& hostile) {
  nlohmann::json c = nlohmann::json::parse(read_text(path));
  std::vector<std::string> keys;
  for (auto& [k, v] : c.items()) keys.push_back(k);
  const std::string key = keys[rng() % keys.size()];
  if (c[key].is_object() && !c[key].empty()) {
    auto it = c[key].begin();
    std::advance(it, rng() % c[key].size());
    it.value() = hostile[rng() % hostile.size()];
  } else {
    c[key] = hostile[rng() % hostile.size()];
  }
  write_text(path, c.dump(2));
}

/** One byte of `path` changed, or the file cut there, or up to 15 bytes
 * from there repeated. */
inline void change_bytes(const std::string& path, std::mt19937_64& rng) {
  std::string s = read_text(path);
  const std::size_t at = rng() % s.size();
  switch (rng() % 3) {
    case 0:
      s[at] = static_cast<char>(rng() & 0xff);
      break;
    case 1:
      s.resize(at);
      break;
    default:
      s.insert(at, s.substr(at, rng() % 16));
      break;
  }
  write_text(path, s);
}

/** One bit flipped in the header (length included) of safetensors file `path`. */
inline void flip_header_bit(const std::string& path, std::mt19937_64& rng) {
  std::string s = read_text(path);
  uint64_t header = 0;
  std::memcpy(&header, s.data(), 8);
  const std::size_t at = rng() % std::min<std::size_t>(s.size(), 8 + header);
  s[at] = static_cast<char>(s[at] ^ (1 << (rng() % 8)));
  write_text(path, s);
}

}  // namespace quanta::testing
