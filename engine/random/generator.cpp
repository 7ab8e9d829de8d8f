// Generator: key derivation and the counter rule (see generator.h).
#include "engine/random/generator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "engine/cpu/parallel.h"
#include "engine/random/philox.h"

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

void PhiloxStream::words(int64_t begin, int64_t end, uint32_t* out) const {
  int64_t i = begin;
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

PhiloxStream Generator::take(int64_t n_words) {
  if (n_words < 0)
    throw std::invalid_argument("[Generator] number of words must be >= 0: got " +
                                std::to_string(n_words));
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
