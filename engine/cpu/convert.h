#pragma once
// Value conversion between element types (16-bit floats go through float).
#include <cstdint>
#include <type_traits>

#include "engine/dtype.h"

namespace quanta::cpu {

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

template <class D, class S>
inline D cast(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (is_half_v<S>) {
    return cast<D>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<D, bool>) {
    return v != S(0);
  } else if constexpr (is_half_v<D>) {
    return D(static_cast<float>(v));
  } else if constexpr (std::is_integral_v<D> && std::is_floating_point_v<S>) {
    // Truncate through i64, then wrap to D's width: one defined rule for
    // every device (a direct float -> u8 conversion of a negative value is
    // undefined, and x86 and CUDA answer it differently).
    return static_cast<D>(static_cast<int64_t>(v));
  } else {
    return static_cast<D>(v);
  }
}

}  // namespace quanta::cpu
