#pragma once
// How a quantizer layer is seeded. A layer takes one 64-bit seed from the
// generator it is built with and keys each of its streams by name from that
// seed (Generator::named), so layers built from the same generator state (on every rank)
// draw identical numbers without communicating.
#include <cstdint>

#include "engine/random/generator.h"

namespace quanta::quant {

/** The next 64 bits of `gen`, as a seed for a layer's streams. */
inline uint64_t draw_seed(Generator& gen) {
  uint32_t w[2];
  gen.fill_u32(w, 2);
  return (static_cast<uint64_t>(w[1]) << 32) | w[0];
}

}  // namespace quanta::quant
