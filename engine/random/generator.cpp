// Generator: key derivation and the counter rule (see generator.h).
#include "engine/random/generator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/capture/device_graph.h"
#include "engine/cpu/parallel.h"
#include "engine/random/philox.h"

#if defined(__AVX512F__)
// g++ 12's AVX-512 headers fill "undefined" pass-through operands from an
// uninitialised variable and then warn about it where the intrinsics inline
// (GCC bug 105593, fixed in 13); the diagnostic state is by location, so
// silencing it around the include silences exactly those lines.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

namespace quanta {
namespace {

// 128-bit offset + block, little-endian 32-bit words (mod 2^128).
std::array<uint32_t, 4> counter_at(PhiloxOffset o, uint64_t block) {
  return philox_counter(o.lo, o.hi, block);
}

std::array<uint32_t, 2> key_words(uint64_t k) {
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

// Words per parallel chunk: a multiple of 4 so chunks start on block edges.
constexpr int64_t kWordGrain = 1 << 16;

}  // namespace

uint32_t PhiloxStream::word(int64_t i) const {
  const auto b = static_cast<uint64_t>(i) / 4;
  return philox4x32_10(counter_at(start, b), key)[static_cast<size_t>(i % 4)];
}

namespace {

// Philox4x32-10 of kLanes consecutive blocks at once, word k of every
// block in one vector: the same arithmetic as philox4x32_10, lane by lane,
// so the same bits. With AVX-512 each round's 32 x 32 -> 64 products are
// vpmuludq on the even and odd lanes (what the compiler made of the plain
// loop, 64-bit multiplies, was half as fast); elsewhere block by block.
constexpr int kLanes = 16;
// Groups of kLanes blocks a call runs together where the stream is long enough.
constexpr int kGroupsAtOnce = 4;

#if defined(__AVX512F__)
// hi and lo words of m * c for the 16 lanes of c.
inline void mul_hi_lo(__m512i c, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(c, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

// The four counter words of blocks first_block .. + kLanes - 1, word k of
// every block in c[k]. Within a group the low word almost never wraps: then
// the counters are one scalar counter plus the lane index; else lane by lane.
inline void counters(PhiloxOffset start, uint64_t first_block, __m512i (&c)[4]) {
  const std::array<uint32_t, 4> c0 = philox_counter(start.lo, start.hi, first_block);
  if (c0[0] <= 0xFFFFFFFFu - (kLanes - 1)) {
    c[0] =
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c0[0])),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int k = 1; k < 4; ++k) c[k] = _mm512_set1_epi32(static_cast<int>(c0[k]));
    return;
  }
  alignas(64) uint32_t w[4][kLanes];
  for (int j = 0; j < kLanes; ++j) {
    const std::array<uint32_t, 4> cj = philox_counter(start.lo, start.hi, first_block + j);
    for (int k = 0; k < 4; ++k) w[k][j] = cj[static_cast<size_t>(k)];
  }
  for (int k = 0; k < 4; ++k) c[k] = _mm512_load_si512(w[k]);
}

// G groups of kLanes blocks each (G * 4 * kLanes words) through the rounds
// together: one group's rounds are a chain of dependent multiplies, and G
// independent chains keep the multiplier busy while each waits.
template <int G>
void philox_lanes(PhiloxOffset start, uint64_t first_block, std::array<uint32_t, 2> key,
                  uint32_t* out) {
  __m512i c[G][4];
  for (int g = 0; g < G; ++g)
    counters(start, first_block + static_cast<uint64_t>(g) * kLanes, c[g]);
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(detail::kPhiloxM0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(detail::kPhiloxM1));
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += detail::kPhiloxW0;
      key[1] += detail::kPhiloxW1;
    }
    const __m512i k0 = _mm512_set1_epi32(static_cast<int>(key[0]));
    const __m512i k1 = _mm512_set1_epi32(static_cast<int>(key[1]));
    for (int g = 0; g < G; ++g) {
      __m512i hi0, lo0, hi1, lo1;
      mul_hi_lo(c[g][0], m0, hi0, lo0);
      mul_hi_lo(c[g][2], m1, hi1, lo1);
      c[g][0] = _mm512_xor_si512(_mm512_xor_si512(hi1, c[g][1]), k0);
      c[g][2] = _mm512_xor_si512(_mm512_xor_si512(hi0, c[g][3]), k1);
      c[g][1] = lo1;
      c[g][3] = lo0;
    }
  }
  for (int g = 0; g < G; ++g) {
    // Back to block order (word k of block j at out[4 j + k]): a 4 x 16
    // transpose. Within each 128-bit lane L the unpacks give blocks 4L..4L+3
    // whole (e, f, g, h); the shuffles then gather lane L of each.
    uint32_t* o = out + g * 4 * kLanes;
    const __m512i a = _mm512_unpacklo_epi32(c[g][0], c[g][1]);
    const __m512i b = _mm512_unpackhi_epi32(c[g][0], c[g][1]);
    const __m512i cc = _mm512_unpacklo_epi32(c[g][2], c[g][3]);
    const __m512i d = _mm512_unpackhi_epi32(c[g][2], c[g][3]);
    const __m512i e = _mm512_unpacklo_epi64(a, cc), f = _mm512_unpackhi_epi64(a, cc);
    const __m512i gg = _mm512_unpacklo_epi64(b, d), h = _mm512_unpackhi_epi64(b, d);
    const __m512i ef02 = _mm512_shuffle_i32x4(e, f, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i gh02 = _mm512_shuffle_i32x4(gg, h, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i ef13 = _mm512_shuffle_i32x4(e, f, _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i gh13 = _mm512_shuffle_i32x4(gg, h, _MM_SHUFFLE(3, 1, 3, 1));
    _mm512_storeu_si512(o, _mm512_shuffle_i32x4(ef02, gh02, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(o + 16, _mm512_shuffle_i32x4(ef13, gh13, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(o + 32, _mm512_shuffle_i32x4(ef02, gh02, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_si512(o + 48, _mm512_shuffle_i32x4(ef13, gh13, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}
#else
template <int G>
void philox_lanes(PhiloxOffset start, uint64_t first_block, std::array<uint32_t, 2> key,
                  uint32_t* out) {
  for (int j = 0; j < G * kLanes; ++j) {
    const auto w = philox4x32_10(philox_counter(start.lo, start.hi, first_block + j), key);
    std::copy(w.begin(), w.end(), out + 4 * j);
  }
}
#endif

}  // namespace

void PhiloxStream::words(int64_t begin, int64_t end, uint32_t* out) const {
  int64_t i = begin;
  // Whole groups of kLanes blocks from the first block edge on.
  const int64_t group_words = 4 * kLanes;
  if (end - begin >= group_words + 4) {
    while (i % 4 != 0) {  // the head, up to the first block edge
      out[i - begin] = word(i);
      ++i;
    }
    for (; i + kGroupsAtOnce * group_words <= end; i += kGroupsAtOnce * group_words)
      philox_lanes<kGroupsAtOnce>(start, static_cast<uint64_t>(i) / 4, key, out + (i - begin));
    for (; i + group_words <= end; i += group_words)
      philox_lanes<1>(start, static_cast<uint64_t>(i) / 4, key, out + (i - begin));
    out += i - begin;
  }
  while (i < end) {
    const auto b = static_cast<uint64_t>(i) / 4;
    const auto w = philox4x32_10(counter_at(start, b), key);
    const int64_t block_end = std::min<int64_t>(end, static_cast<int64_t>(b + 1) * 4);
    for (; i < block_end; ++i) *out++ = w[static_cast<size_t>(i % 4)];
  }
}

Generator::Generator(uint64_t seed) : seed_(seed), key_(seed) {}

Generator::Generator(const GeneratorState& s) : seed_(s.seed), key_(s.key), offset_(s.offset) {}

Generator Generator::named(uint64_t seed, std::string_view name) {
  return Generator(seed).fork(name);
}

Generator Generator::fork(std::string_view name) const {
  Generator g(seed_);
  g.key_ = detail::derive_key(key_, name);
  return g;
}

void Generator::set_state(const GeneratorState& s) {
  seed_ = s.seed;
  key_ = s.key;
  offset_ = s.offset;
}

namespace {
thread_local uint64_t t_unreplayable_draws = 0;
thread_local int t_replayable_draw = 0;
}  // namespace

uint64_t unreplayable_draws_on_this_thread() { return t_unreplayable_draws; }

detail::ReplayableDraw::ReplayableDraw() { ++t_replayable_draw; }
detail::ReplayableDraw::~ReplayableDraw() { --t_replayable_draw; }

PhiloxStream Generator::take(int64_t n_words) {
  if (n_words < 0)
    throw std::invalid_argument("[Generator] number of words must be >= 0: got " +
                                std::to_string(n_words));
  if (t_replayable_draw == 0) {
    // A host draw's numbers are the host's: a graph would replay this
    // draw's words, or what the host made of them, at every step.
    if (capture_open())
      throw std::logic_error(
          "[Generator] a random draw for the host inside a captured step: every replay would "
          "use the same numbers");
    ++t_unreplayable_draws;
  }
  PhiloxStream s{key_words(key_), offset_};
  const uint64_t blocks = (static_cast<uint64_t>(n_words) + 3) / 4;
  const uint64_t lo = offset_.lo + blocks;
  offset_.hi += lo < blocks ? 1 : 0;
  offset_.lo = lo;
  return s;
}

void Generator::fill_u32(uint32_t* out, int64_t n) {
  const PhiloxStream s = take(n);
  cpu::parallel_for(0, (n + kWordGrain - 1) / kWordGrain, 1, [&](int64_t lo, int64_t hi) {
    const int64_t begin = lo * kWordGrain, end = std::min(n, hi * kWordGrain);
    s.words(begin, end, out + begin);
  });
}

}  // namespace quanta
