#pragma once
// What reading and writing safetensors files share (engine/io/
// safetensors.cpp, safetensors_write.cpp): the spec's dtypes and how names
// are quoted in errors. Internal to engine/io.
#include <array>
#include <optional>
#include <string>

#include "engine/dtype.h"

namespace quanta::io::safetensors_spec {

// Metadata key prefix naming the dtype and shape of a tensor stored as raw
// U8 bytes because safetensors has no such dtype (nf4): "nf4 [4096, 4096]".
inline const std::string kBlockDTypeKey = "quanta.dtype.";

// A dtype of the safetensors spec. `rank` is its position in the reference
// `Dtype` enum (increasing alignment), which the reference writer sorts by.
struct SpecDType {
  const char* name;
  int rank;
  int bits;
  std::optional<DType> dtype;  // empty: quanta has no matching dtype
};

// clang-format off
inline constexpr std::array<SpecDType, 20> kSpecDTypes = {{
    {"BOOL", 0, 8, DType::boolean},
    {"F4", 1, 4, std::nullopt},
    {"F6_E2M3", 2, 6, std::nullopt},
    {"F6_E3M2", 3, 6, std::nullopt},
    {"U8", 4, 8, DType::u8},
    {"I8", 5, 8, std::nullopt},
    {"F8_E5M2", 6, 8, std::nullopt},
    {"F8_E4M3", 7, 8, std::nullopt},
    {"F8_E8M0", 8, 8, std::nullopt},
    {"I16", 9, 16, std::nullopt},
    {"U16", 10, 16, std::nullopt},
    {"F16", 11, 16, DType::f16},
    {"BF16", 12, 16, DType::bf16},
    {"I32", 13, 32, DType::i32},
    {"U32", 14, 32, std::nullopt},
    {"F32", 15, 32, DType::f32},
    {"C64", 16, 64, std::nullopt},
    {"F64", 17, 64, DType::f64},
    {"I64", 18, 64, DType::i64},
    {"U64", 19, 64, std::nullopt},
}};
// clang-format on

inline const SpecDType* find_spec(const std::string& name) {
  for (const auto& s : kSpecDTypes)
    if (name == s.name) return &s;
  return nullptr;
}

inline const SpecDType* find_spec(DType t) {
  for (const auto& s : kSpecDTypes)
    if (s.dtype == t) return &s;
  return nullptr;
}

// Names can be as long as the header: keep error messages to one readable line.
inline std::string quote_name(const std::string& s) {
  constexpr std::size_t kMax = 80;
  std::string out = "'";
  for (char c : s.size() > kMax ? s.substr(0, kMax) : s)
    out += (static_cast<unsigned char>(c) < 0x20) ? '?' : c;
  return out + (s.size() > kMax ? "...'" : "'");
}

}  // namespace quanta::io::safetensors_spec
