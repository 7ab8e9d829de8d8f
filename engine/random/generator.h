#pragma once
// Counter-based random streams. A stream is (key, counter offset) over
// Philox4x32-10; there is no hidden state and no global default generator.
//
// The counter rule (what makes streams identical on every rank, thread and
// device): a draw of n 32-bit words at offset `o` under key `k` gives
//
//     word i = philox4x32_10(counter = o + i / 4, key = k)[i % 4]
//
// where the 128-bit counter is split into 32-bit words low word first
// ({c & 0xffffffff, (c >> 32) & 0xffffffff, (c >> 64) & ..., c >> 96}) and
// the 64-bit key likewise ({k & 0xffffffff, k >> 32}). Word i depends only on
// (key, offset, i), so any thread or CUDA block may compute any slice. After
// the draw the offset has advanced by ceil(n / 4) blocks: every draw starts on
// a fresh block, and the remaining words of a partly used block are skipped.
//
// Named streams: key(name) = splitmix64(splitmix64(parent_key) ^ fnv1a64(name))
// with FNV-1a 64 over the name's bytes (offset basis 0xcbf29ce484222325,
// prime 0x100000001b3) and Vigna's splitmix64 finaliser. Pure 64-bit integer
// arithmetic: every process that knows the seed and the name derives the same
// key with no communication.
//
// A Generator is a small value: copy it to replay a stream. It is not
// synchronised: give each thread its own (fork by name) or guard it.
#include <array>
#include <cstdint>
#include <string_view>

namespace quanta {

/** A 128-bit philox counter offset, in blocks of four words. */
struct PhiloxOffset {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const PhiloxOffset&, const PhiloxOffset&) = default;
};

/** Everything a Generator is, for checkpoints: four 64-bit words. */
struct GeneratorState {
  uint64_t seed = 0;  // the root seed (informational: fork uses `key`)
  uint64_t key = 0;   // philox key, low 32 bits = key word 0
  PhiloxOffset offset;
  friend bool operator==(const GeneratorState&, const GeneratorState&) = default;
};

/** A fixed slice of a stream: pure (key, start offset), no state. What a
 * sampler hands to its parallel loops (and later to CUDA kernels). */
struct PhiloxStream {
  std::array<uint32_t, 2> key{};
  PhiloxOffset start;

  /** Word i of the stream: philox(start + i / 4, key)[i % 4]. */
  uint32_t word(int64_t i) const;
  /** Writes words [begin, end) of the stream to out[0 .. end - begin). */
  void words(int64_t begin, int64_t end, uint32_t* out) const;
};

namespace detail {
/** splitmix64 finaliser (Steele, Lea, Flood; constants from Vigna). */
constexpr uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/** FNV-1a 64 of the bytes of `s`. */
constexpr uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}
/** The key of the stream named `name` under `parent_key`. */
constexpr uint64_t derive_key(uint64_t parent_key, std::string_view name) {
  return splitmix64(splitmix64(parent_key) ^ fnv1a64(name));
}
}  // namespace detail

class Generator {
 public:
  /** The root stream of `seed`: key = seed (its two 32-bit halves), offset 0. */
  explicit Generator(uint64_t seed);
  /** A generator restored from `state()`. */
  explicit Generator(const GeneratorState& state);

  /** The stream `name` of `seed`; equal to Generator(seed).fork(name). */
  static Generator named(uint64_t seed, std::string_view name);
  /** A child stream keyed by (this key, name) at offset 0; independent of
   * this generator's offset, so forking the same name twice gives the same
   * stream. Nested forks ("a" then "b") differ from a fork of "b". */
  Generator fork(std::string_view name) const;

  /** The root seed this generator descends from. */
  uint64_t seed() const { return seed_; }
  /** The 64-bit philox key (word 0 = low half). */
  uint64_t key() const { return key_; }
  /** The counter offset, in blocks of four words, of the next draw. */
  PhiloxOffset offset() const { return offset_; }
  /** Moves the stream to `offset` (blocks of four words). */
  void set_offset(PhiloxOffset offset) { offset_ = offset; }
  /** Seed, key and offset: all there is to save. */
  GeneratorState state() const { return {seed_, key_, offset_}; }
  /** Restores a state saved with state(). */
  void set_state(const GeneratorState& s);

  /** The next `n_words` words as a stream slice, advancing the offset by
   * ceil(n_words / 4) blocks (the primitive every sampler draws through). */
  PhiloxStream take(int64_t n_words);
  /** Fills out[0..n) with the next n words (counter rule above); the offset
   * advances by ceil(n / 4). Parallel for large n. */
  void fill_u32(uint32_t* out, int64_t n);

  /** Declares that this object outlives every graph that captures a draw
   * from it (a layer's own stream): a device draw from it inside a capture
   * (engine/capture/device_graph.h) is made again from it at each replay,
   * so each replay draws the numbers the step would. Belongs to the object,
   * not its value: a copy is not an owner. A copy of an owner may draw in a
   * capture only a stream an earlier draw of the same capture took
   * (dropout's backward drawing its forward's mask again). */
  void set_replayable() { replay_ = Replay::owner; }
  /** How a capture may replay draws from this object. */
  enum class Replay : uint8_t { no, owner, copy };
  Replay replay() const { return replay_; }

  Generator(const Generator& other)
      : seed_(other.seed_),
        key_(other.key_),
        offset_(other.offset_),
        replay_(other.replay_ == Replay::no ? Replay::no : Replay::copy) {}
  /** Takes `other`'s stream; an owner stays one. */
  Generator& operator=(const Generator& other) {
    seed_ = other.seed_;
    key_ = other.key_;
    offset_ = other.offset_;
    if (replay_ != Replay::owner) replay_ = other.replay_ == Replay::no ? Replay::no : Replay::copy;
    return *this;
  }

 private:
  uint64_t seed_;
  uint64_t key_;
  PhiloxOffset offset_;
  Replay replay_ = Replay::no;
};

/** Streams taken on this thread so far that a graph could not replay: every
 * take() but a device fill's from a replayable generator (above). A step
 * that makes none can be captured (train/captured_step.h). */
uint64_t unreplayable_draws_on_this_thread();

namespace detail {
/** While one is alive on this thread, take() is a device fill's draw that a
 * capture replays (engine/random/sampling.cpp): not refused inside a
 * capture, not counted above. */
class ReplayableDraw {
 public:
  ReplayableDraw();
  ~ReplayableDraw();
  ReplayableDraw(const ReplayableDraw&) = delete;
  ReplayableDraw& operator=(const ReplayableDraw&) = delete;
};
}  // namespace detail

}  // namespace quanta
