// Philox is header-only (constexpr); the Random123 known-answer vectors are
// checked here at compile time so a broken edit fails the build, not a run.
#include "engine/random/philox.h"

namespace quanta {
namespace {

using W4 = std::array<uint32_t, 4>;
using W2 = std::array<uint32_t, 2>;

static_assert(philox4x32_10(W4{0, 0, 0, 0}, W2{0, 0}) ==
              W4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
static_assert(philox4x32_10(W4{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                            W2{0xffffffffu, 0xffffffffu}) ==
              W4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
static_assert(philox4x32_10(W4{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                            W2{0xa4093822u, 0x299f31d0u}) ==
              W4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});

}  // namespace
}  // namespace quanta
