#pragma once
// Philox words -> values: the rules every sampler and both kernel tables'
// random_fill use, written once for g++ and nvcc (QUANTA_HD), so the CPU
// tests cover the GPU's draws. A fill of n elements is cut into groups of
// W consecutive words (W = 1, 2 or 4, so a Philox block of four words holds
// 4 / W whole groups); group g reads words [g W, (g + 1) W) of its stream and
// writes elements [g E, (g + 1) E):
//
//   uniform  f32   W 1 E 1  (w >> 8) 2^-24            [0, 1), 24 bits
//            bf16  W 1 E 1  (w >> 24) 2^-8            exact on bf16's grid
//            f16   W 1 E 1  (w >> 21) 2^-11           exact on f16's grid
//            f64   W 2 E 1  (u64 >> 11) 2^-53          u64 = w1:w0
//   normal   f32   W 2 E 2  Box-Muller in f64, u1 = (w0 + 1) / 2^32 in (0, 1],
//                           u2 = w1 / 2^32: r cos(2 pi u2), r sin(2 pi u2)
//            f64   W 4 E 2  u1 = ((u64(w0, w1) >> 11) + 1) 2^-53, u2 = u53(w2, w3)
//   integer  i64   W 2 E 1  low + floor(u64 (high - low) / 2^64) (multiply-shift)
//   bits     i64   W 2 E 1  u64's 64 bits (randperm's sort keys)
//   bernoulli f32, f64, bf16, f16
//                  W 1 E 1  1 if w < ceil(p 2^32) (so w 2^-32 < p exactly), else 0
//
// An affine uniform or normal fill (uniform_, normal_) then maps v to
// fma(scale, v, shift) in the draw dtype: shift + scale * v rounded once.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "engine/dtype.h"
#include "engine/kernels/functors.h"  // QUANTA_HD
#include "engine/kernels/table.h"     // RandomFill
#include "engine/random/philox.h"

namespace quanta {

namespace draw {

inline constexpr double kTwoPi = 6.283185307179586;
inline constexpr double k2Pow32 = 4294967296.0;

/** Words per group (W) and elements per group (E) of a fill. */
struct Grouping {
  int words = 1;
  int elements = 1;
};

/** W and E of `draw` in `dtype`; throws naming "random fill" for a pair
 * without a rule. */
inline Grouping grouping(RandomDraw d, DType t) {
  const bool f64 = t == DType::f64;
  switch (d) {
    case RandomDraw::uniform:
      if (t == DType::f32 || t == DType::bf16 || t == DType::f16) return {1, 1};
      if (f64) return {2, 1};
      break;
    case RandomDraw::normal:
      if (t == DType::f32) return {2, 2};
      if (f64) return {4, 2};
      break;
    case RandomDraw::integer:
    case RandomDraw::bits:
      if (t == DType::i64) return {2, 1};
      break;
    case RandomDraw::bernoulli:
      if (t == DType::f32 || t == DType::bf16 || t == DType::f16 || f64) return {1, 1};
      break;
  }
  throw std::invalid_argument(std::string("[random fill] no draw rule for dtype ") + dtype_name(t));
}

/** Calls fn.template operator()<W, T>() for a fill of `dtype` grouped as gr:
 * W its words per group, T its element type (float, double, int64_t, or the
 * calling side's 16-bit types BF16 and F16). Every device's random_fill
 * dispatches through here, so they instantiate the same (W, T) pairs. */
template <class BF16, class F16, class Fn>
void dispatch_fill(const Grouping& gr, DType dtype, Fn&& fn) {
  auto with_words = [&]<class T>() {
    if (gr.words == 1) return fn.template operator()<1, T>();
    if (gr.words == 2) return fn.template operator()<2, T>();
    return fn.template operator()<4, T>();
  };
  switch (dtype) {
    case DType::f32:
      return with_words.template operator()<float>();
    case DType::f64:
      return with_words.template operator()<double>();
    case DType::bf16:
      return with_words.template operator()<BF16>();
    case DType::f16:
      return with_words.template operator()<F16>();
    default:
      return with_words.template operator()<int64_t>();
  }
}

/** Groups of a fill of n elements: ceil(n / E). */
inline int64_t groups(const Grouping& g, int64_t n) { return (n + g.elements - 1) / g.elements; }

/** Philox blocks (four words) that hold a fill's groups: a CUDA thread
 * each. W divides 4, so no group straddles two blocks. */
inline int64_t blocks(const Grouping& g, int64_t n) { return (groups(g, n) * g.words + 3) / 4; }

/** Words a fill of n elements takes from its generator (what Generator::take
 * is given; the offset then advances by ceil(words / 4) blocks). */
inline int64_t words(RandomDraw d, DType t, int64_t n) {
  const Grouping g = grouping(d, t);
  return groups(g, n) * g.words;
}

QUANTA_HD constexpr uint64_t u64_of(const uint32_t* w) {
  return (static_cast<uint64_t>(w[1]) << 32) | w[0];
}
/** [0, 1) with 53 random bits of two words. */
QUANTA_HD constexpr double u53(const uint32_t* w) {
  return static_cast<double>(u64_of(w) >> 11) * 0x1p-53;
}
/** (0, 1] with 53 random bits of two words. */
QUANTA_HD constexpr double u53_open0(const uint32_t* w) {
  return static_cast<double>((u64_of(w) >> 11) + 1) * 0x1p-53;
}

/** High 64 bits of a * b, portably (no 128-bit integer type). */
QUANTA_HD constexpr uint64_t mulhi64(uint64_t a, uint64_t b) {
  const uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32;
  const uint64_t b_lo = b & 0xffffffffu, b_hi = b >> 32;
  const uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo;
  const uint64_t lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
  const uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
  return (hi_lo >> 32) + (cross >> 32) + hi_hi;
}
static_assert(mulhi64(~0ull, ~0ull) == ~0ull - 1);
static_assert(mulhi64(1ull << 63, 6) == 3);

QUANTA_HD constexpr float uniform_f32(uint32_t w) { return static_cast<float>(w >> 8) * 0x1p-24f; }
/** A value on bf16's grid (exact when converted). */
QUANTA_HD constexpr float uniform_bf16(uint32_t w) { return static_cast<float>(w >> 24) * 0x1p-8f; }
/** A value on f16's grid (exact when converted). */
QUANTA_HD constexpr float uniform_f16(uint32_t w) { return static_cast<float>(w >> 21) * 0x1p-11f; }
QUANTA_HD constexpr double uniform_f64(const uint32_t* w) { return u53(w); }

/** The `below` of a bernoulli(p) fill: a word w gives 1 exactly when
 * w 2^-32 < p, i.e. w < p 2^32 (exact in f64: a power-of-two scaling), i.e.
 * w < ceil(p 2^32), which lies in [0, 2^32] for p in [0, 1]. */
inline uint64_t bernoulli_below(double p) { return static_cast<uint64_t>(std::ceil(p * k2Pow32)); }

/** Bernoulli's 0 or 1 for word w (exact in every floating dtype). */
QUANTA_HD constexpr float bernoulli(uint32_t w, uint64_t below) { return w < below ? 1.0f : 0.0f; }

/** low + floor(u64 * range / 2^64), in wrapping unsigned arithmetic. */
QUANTA_HD constexpr int64_t integer(const uint32_t* w, int64_t low, uint64_t range) {
  return static_cast<int64_t>(static_cast<uint64_t>(low) + mulhi64(u64_of(w), range));
}

/** Two standard normals (computed in f64). */
struct NormalPair {
  double z0, z1;
};
QUANTA_HD inline NormalPair box_muller(double u1, double u2) {
  const double r = std::sqrt(-2.0 * std::log(u1)), t = kTwoPi * u2;
  return {r * std::cos(t), r * std::sin(t)};
}
/** The pair of an f32 normal fill (two words). */
QUANTA_HD inline NormalPair normal_f32(const uint32_t* w) {
  return box_muller((static_cast<double>(w[0]) + 1.0) / k2Pow32,
                    static_cast<double>(w[1]) / k2Pow32);
}
/** The pair of an f64 normal fill (four words). */
QUANTA_HD inline NormalPair normal_f64(const uint32_t* w) {
  return box_muller(u53_open0(w), u53(w + 2));
}

/** shift + scale * v in T, rounded once on every device. Whether a compiler
 * contracts `shift + scale * v` into a fused multiply-add depends on the
 * compiler, its flags and how the loop was vectorised (g++ 13 on the first
 * GPU machine did not, nvcc does): where shift cancels scale * v the two
 * roundings differ by many ulps, so both sides say fma. */
template <class T>
QUANTA_HD inline T affine(T scale, T shift, T v) {
#if defined(__CUDA_ARCH__)
  return fma(scale, v, shift);
#else
  return std::fma(scale, v, shift);
#endif
}

/** Group g of fill f (n elements in all) into out, from the group's W
 * words w. T is the element type of f.dtype on the calling side (CUDA's own
 * 16-bit types on the device); 16-bit values are exact on their grid, so the
 * conversion does not round. A (T, W) pair with no rule (grouping() never
 * hands one out) writes nothing, so no instantiation reads past its words. */
template <int W, class T>
QUANTA_HD inline void fill_group(const RandomFill& f, int64_t n, int64_t g, const uint32_t* w,
                                 T* out) {
  constexpr bool f64 = std::is_same_v<T, double>;
  if constexpr (std::is_same_v<T, int64_t>) {
    if constexpr (W == 2)
      out[g] =
          f.draw == RandomDraw::bits ? static_cast<int64_t>(u64_of(w)) : integer(w, f.low, f.range);
  } else if constexpr (f64 || std::is_same_v<T, float>) {
    const T a = static_cast<T>(f.scale), b = static_cast<T>(f.shift);
    auto put = [&](int64_t i, T v) { out[i] = f.affine ? affine(a, b, v) : v; };
    (void)put;  // unused where (T, W) has no rule
    if (f.draw == RandomDraw::bernoulli) {
      if constexpr (W == 1) {
        put(g, static_cast<T>(bernoulli(w[0], f.below)));
        if (f.times) {
          const T m = out[g];
          out[g] = static_cast<const T*>(f.times)[g] * m;
          if (f.out2) static_cast<T*>(f.out2)[g] = static_cast<const T*>(f.times2)[g] * m;
        }
      }
    } else if (f.draw == RandomDraw::uniform) {
      if constexpr (f64 && W == 2) put(g, uniform_f64(w));
      if constexpr (!f64 && W == 1) put(g, uniform_f32(w[0]));
    } else if constexpr (W == (f64 ? 4 : 2)) {
      const NormalPair z = f64 ? normal_f64(w) : normal_f32(w);
      put(2 * g, static_cast<T>(z.z0));
      if (2 * g + 1 < n) put(2 * g + 1, static_cast<T>(z.z1));
    }
  } else if constexpr (W == 1) {
    out[g] = static_cast<T>(f.draw == RandomDraw::bernoulli ? bernoulli(w[0], f.below)
                            : f.dtype == DType::bf16        ? uniform_bf16(w[0])
                                                            : uniform_f16(w[0]));
  }
}

/** Where a fill's stream lives in device memory (RandomFill::stream_at),
 * the stream put into `f` itself; the kernels call it first. */
QUANTA_HD inline void resolve_stream(RandomFill& f) {
  if (!f.stream_at) return;
  const uint64_t key = f.stream_at[0];
  f.key[0] = static_cast<uint32_t>(key);
  f.key[1] = static_cast<uint32_t>(key >> 32);
  f.start_lo = f.stream_at[1];
  f.start_hi = f.stream_at[2];
  f.stream_at = nullptr;
}

/** Philox block b of fill f: its four words and the 4 / W groups they hold
 * (what one CUDA thread does; the CPU tests run it to check the device's
 * indexing against the CPU's fill). */
template <int W, class T>
QUANTA_HD inline void fill_block(const RandomFill& f, int64_t n, int64_t groups, int64_t b,
                                 T* out) {
  static_assert(W == 1 || W == 2 || W == 4, "a group must not straddle two blocks");
  constexpr int kPerBlock = 4 / W;
  const auto r = philox4x32_10(philox_counter(f.start_lo, f.start_hi, static_cast<uint64_t>(b)),
                               {f.key[0], f.key[1]});
  const uint32_t w[4] = {r[0], r[1], r[2], r[3]};
  for (int j = 0; j < kPerBlock; ++j) {
    const int64_t g = b * kPerBlock + j;
    if (g < groups) fill_group<W>(f, n, g, w + j * W, out);
  }
}

}  // namespace draw
}  // namespace quanta
