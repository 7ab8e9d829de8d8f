// Philox known answers and the Generator's counter rule, named streams and
// checkpoint state. Expected constants were computed independently (Random123
// kat_vectors; a Python transcription of splitmix64, FNV-1a and Philox).
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "quanta.h"

using namespace quanta;

namespace {

using W4 = std::array<uint32_t, 4>;
using W2 = std::array<uint32_t, 2>;

std::vector<uint32_t> draw(Generator& g, int64_t n) {
  std::vector<uint32_t> w(static_cast<size_t>(n));
  g.fill_u32(w.data(), n);
  return w;
}

// The documented counter rule, written out independently of the Generator.
uint32_t rule_word(uint64_t key, PhiloxOffset o, int64_t i) {
  const uint64_t b = static_cast<uint64_t>(i) / 4;
  const uint64_t lo = o.lo + b;
  const uint64_t hi = o.hi + (lo < b ? 1 : 0);
  const W4 c{static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32), static_cast<uint32_t>(hi),
             static_cast<uint32_t>(hi >> 32)};
  return philox4x32_10(c, W2{static_cast<uint32_t>(key),
                             static_cast<uint32_t>(key >> 32)})[static_cast<size_t>(i % 4)];
}

}  // namespace

TEST_CASE("philox4x32_10 reproduces the Random123 known-answer vectors") {
  // Runtime calls (the same vectors are also static_asserts in philox.cpp).
  volatile uint32_t zero = 0;  // keeps the compiler from folding everything
  CHECK(philox4x32_10(W4{zero, 0, 0, 0}, W2{0, 0}) ==
        W4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  CHECK(philox4x32_10(W4{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu | zero},
                      W2{0xffffffffu, 0xffffffffu}) ==
        W4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  CHECK(philox4x32_10(W4{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u | zero},
                      W2{0xa4093822u, 0x299f31d0u}) ==
        W4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("Generator: word i depends only on (key, offset, i); offset += ceil(n/4)") {
  const uint64_t seed = 0x123456789abcdef0ull;
  Generator g(seed);
  CHECK(g.key() == seed);
  CHECK(g.offset() == PhiloxOffset{0, 0});
  g.set_offset({5, 0});
  const auto w = draw(g, 11);
  for (int64_t i = 0; i < 11; ++i) CHECK(w[static_cast<size_t>(i)] == rule_word(seed, {5, 0}, i));
  // Key words are the seed's halves, low first: word 0 of block 5 by hand.
  CHECK(w[0] == philox4x32_10(W4{5, 0, 0, 0}, W2{0x9abcdef0u, 0x12345678u})[0]);
  CHECK(g.offset() == PhiloxOffset{8, 0});  // 5 + ceil(11 / 4)

  for (int64_t n : {0, 1, 3, 4, 5, 8, 9}) {
    Generator h(7);
    draw(h, n);
    CHECK(h.offset().lo == static_cast<uint64_t>((n + 3) / 4));
  }
}

TEST_CASE("Generator: n then m equals one draw of n+m exactly when n % 4 == 0") {
  Generator one(99), two(99);
  const auto big = draw(one, 20);
  // n = 8: the second draw starts at block 2 = word 8, so the draws concatenate.
  const auto a = draw(two, 8);
  const auto b = draw(two, 5);
  for (size_t i = 0; i < 8; ++i) CHECK(a[i] == big[i]);
  for (size_t i = 0; i < 5; ++i) CHECK(b[i] == big[8 + i]);

  // n = 6: words 6, 7 of block 1 are skipped; the next draw starts at word 8.
  Generator three(99);
  const auto c = draw(three, 6);
  const auto d = draw(three, 5);
  for (size_t i = 0; i < 6; ++i) CHECK(c[i] == big[i]);
  for (size_t i = 0; i < 5; ++i) CHECK(d[i] == big[8 + i]);
  CHECK(d[0] != big[6]);
}

TEST_CASE("Generator: set_offset reproduces a stream") {
  Generator g(5);
  draw(g, 40);
  const PhiloxOffset at = g.offset();
  const auto first = draw(g, 17);
  g.set_offset(at);
  CHECK(draw(g, 17) == first);
  // Jumping straight to an offset gives the same words as drawing up to it.
  Generator h(5);
  h.set_offset({10, 0});
  CHECK(draw(h, 17) == first);
}

TEST_CASE("Generator: the 128-bit counter carries and wraps") {
  Generator g(3);
  g.set_offset({~0ull, 0});
  const auto w = draw(g, 8);
  const W2 k{3, 0};
  CHECK(w[0] == philox4x32_10(W4{0xffffffffu, 0xffffffffu, 0, 0}, k)[0]);
  CHECK(w[4] == philox4x32_10(W4{0, 0, 1, 0}, k)[0]);
  CHECK(g.offset() == PhiloxOffset{1, 1});

  g.set_offset({~0ull, ~0ull});
  const auto v = draw(g, 8);
  CHECK(v[7] == philox4x32_10(W4{0, 0, 0, 0}, k)[3]);
  CHECK(g.offset() == PhiloxOffset{1, 0});
}

TEST_CASE("Generator: parallel fill equals the rule word by word") {
  const int64_t n = (1 << 20) + 3;
  Generator g(11);
  g.set_offset({123, 4});
  const PhiloxStream s = Generator(g).take(n);
  const auto w = draw(g, n);
  for (int64_t i = 0; i < n; i += 997) CHECK(w[static_cast<size_t>(i)] == s.word(i));
  CHECK(w.back() == rule_word(11, {123, 4}, n - 1));
  // Same words whatever the thread count.
  const int threads = num_threads();
  set_num_threads(1);
  Generator h(11);
  h.set_offset({123, 4});
  const auto serial = draw(h, n);
  set_num_threads(threads);
  CHECK(serial == w);
}

TEST_CASE("Generator: take slices and refuses negative counts") {
  Generator g(1);
  const PhiloxStream s = g.take(6);
  CHECK(g.offset().lo == 2);
  std::vector<uint32_t> part(3);
  s.words(2, 5, part.data());
  for (int64_t i = 2; i < 5; ++i) CHECK(part[static_cast<size_t>(i - 2)] == rule_word(1, {}, i));
  CHECK_THROWS_AS(g.take(-1), std::invalid_argument);
  CHECK(g.offset().lo == 2);
}

TEST_CASE("PhiloxStream::words: the block-group path gives word(i) for every slice") {
  // words() runs whole groups of 16 blocks through a vectorised loop, with
  // a scalar head up to the first block edge and a scalar tail: every start
  // and length around those edges, and a counter that carries into its high
  // 64 bits inside a group.
  // Long slices take four groups at a time, and a low counter word that
  // wraps inside a group takes the lane-by-lane counters.
  for (const PhiloxOffset start : {PhiloxOffset{5, 0}, PhiloxOffset{~uint64_t{0} - 20, 7},
                                   PhiloxOffset{0xFFFFFFFFull - 40, 3}}) {
    const PhiloxStream s{{0x1234u, 0xABCDu}, start};
    for (int64_t begin : {0, 1, 3, 4, 63, 64, 65}) {
      for (int64_t n : {0, 1, 67, 68, 69, 127, 128, 129, 300, 1023, 1024, 1091}) {
        CAPTURE(begin);
        CAPTURE(n);
        std::vector<uint32_t> got(static_cast<size_t>(n) + 1, 0xDEADBEEFu);
        s.words(begin, begin + n, got.data());
        bool same = true;
        for (int64_t i = 0; i < n; ++i)
          same = same && got[static_cast<size_t>(i)] == s.word(begin + i);
        CHECK(same);
        CHECK(got.back() == 0xDEADBEEFu);  // nothing past the end
      }
    }
  }
}

TEST_CASE("Generator: named streams are stable, platform-independent hashes") {
  // Pinned against an independent implementation of the documented formula.
  CHECK(detail::fnv1a64("") == 0xcbf29ce484222325ull);
  CHECK(detail::fnv1a64("a") == 0xaf63dc4c8601ec8cull);
  CHECK(detail::splitmix64(0) == 0xe220a8397b1dcdafull);
  Generator g = Generator::named(42, "rvq.dropout");
  CHECK(g.key() == 0x71cc53890a526f26ull);
  CHECK(g.seed() == 42);
  CHECK(draw(g, 4) == std::vector<uint32_t>{0x536124feu, 0xda5aab09u, 0x30306f5eu, 0x4d94239eu});
  CHECK(Generator(7).fork("a").fork("b").key() == 0x4e1e8965ab4df023ull);
}

TEST_CASE("Generator: same seed and name agree, different names or seeds differ") {
  Generator a1 = Generator::named(42, "codebook.init");
  Generator a2 = Generator::named(42, "codebook.init");
  Generator b = Generator::named(42, "codebook.replace");
  Generator c = Generator::named(43, "codebook.init");
  const auto wa1 = draw(a1, 64), wa2 = draw(a2, 64), wb = draw(b, 64), wc = draw(c, 64);
  CHECK(wa1 == wa2);
  CHECK(wa1 != wb);
  CHECK(wa1 != wc);
  CHECK(wb != wc);
  // named(seed, name) is Generator(seed).fork(name); fork ignores the offset.
  Generator root(42);
  draw(root, 9);
  Generator f = root.fork("codebook.init");
  CHECK(f.offset() == PhiloxOffset{});
  CHECK(draw(f, 64) == wa1);
  // Nested forks are their own streams.
  CHECK(Generator(42).fork("x").fork("y").key() != Generator(42).fork("y").key());
  CHECK(Generator(42).fork("x").fork("y").key() != Generator(42).fork("x").key());
  CHECK(Generator::named(42, "").key() != Generator(42).key());
}

TEST_CASE("Generator: state round-trips for checkpoints") {
  Generator g = Generator::named(9, "train");
  draw(g, 13);
  const GeneratorState st = g.state();
  CHECK(st.seed == 9);
  CHECK(st.key == g.key());
  CHECK(st.offset == PhiloxOffset{4, 0});
  const auto next = draw(g, 10);

  Generator restored(st);
  CHECK(restored.state() == st);
  CHECK(draw(restored, 10) == next);

  Generator other(1);
  other.set_state(st);
  CHECK(draw(other, 10) == next);
  CHECK(other.fork("x").key() == g.fork("x").key());
}
