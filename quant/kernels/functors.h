#pragma once
// The quantizer kernels' per-element and per-row math, written once for g++
// and nvcc (as engine/kernels/functors.h is for the engine's). The CPU
// kernels (quant/cpu/) call these where doing so keeps their results bit for
// bit, and the CUDA kernels (quant/cuda/) call the same functions, so the CPU
// tests cover the math the GPU runs. No loops over tensors here: one element,
// one row or one pair of candidates at a time.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/kernels/functors.h"         // QUANTA_HD
#include "engine/kernels/optim_functors.h"   // mul_add, the _rn steps
#include "engine/kernels/reduce_functors.h"  // fold_loaded
#include "quant/kernels/nf4_layout.h"

namespace quanta::quant::fn {

// ---- the codebook EMA: the single-op kernels' roundings, fused ----

/** x keep + alpha a as mul_(x, keep) then add_(x, a, alpha) round it: the
 * product rounded, then add_'s d + alpha a (contracted where the update
 * kernel is: quanta::fn::mul_add). */
template <class T>
QUANTA_HD inline T ema_lerp(T x, T a, T keep, T alpha) {
  return quanta::fn::mul_add(alpha, a, quanta::fn::mul_rn(x, keep));
}

/** A code's Laplace-smoothed cluster size, (size + eps) / (total + k eps)
 * total, each step rounded to T as the composed ops round it (k_eps: k eps
 * computed in f64, then rounded). */
template <class T>
QUANTA_HD inline T smoothed_size(T size, T total, T eps, T k_eps) {
  using quanta::fn::add_rn;
  return quanta::fn::mul_rn(quanta::fn::div_rn(add_rn(size, eps), add_rn(total, k_eps)), total);
}

// ---- nearest_codes: a running argmin with the CPU's tie and NaN rules ----

/** The index an ArgMin holds while no score has won. */
inline constexpr int64_t kNoIndex = std::numeric_limits<int64_t>::max();

/** The smallest score seen so far and its index. */
template <class T>
struct ArgMin {
  T value = std::numeric_limits<T>::infinity();
  int64_t index = kNoIndex;
};

/** Offers score v of index j, scanned in increasing j: a strict < keeps the
 * first of equal scores, and a NaN never wins. */
template <class T>
QUANTA_HD void argmin_offer(ArgMin<T>& a, T v, int64_t j) {
  if (v < a.value) a.value = v, a.index = j;
}

/** Merges two partial scans (any order): the smaller score, the smaller index
 * among equal ones. */
template <class T>
QUANTA_HD ArgMin<T> argmin_merge(ArgMin<T> a, ArgMin<T> b) {
  return (b.value < a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

/** Lane `lane` of `lanes`' scan of a row's tile of kc scores, offered as
 * codes c0 + j: the lane takes columns j = lane, lane + lanes, ... in
 * increasing order, each score plus bias[j] where bias (the tile's) is not
 * null, and reads kStridedLoads of them before offering any (fold_loaded:
 * the plain loop kept the 4 loads nvcc's unrolling gave it in flight, and
 * the H200 searched 1024 codes in 1.24x the time of their GEMM). Merged over
 * the lanes, the tile's argmin. */
template <class T>
QUANTA_HD ArgMin<T> argmin_lane_scan(const T* row, const T* bias, int64_t kc, int64_t c0,
                                     int64_t lane, int64_t lanes) {
  const int64_t n = lane < kc ? (kc - lane + lanes - 1) / lanes : 0;
  return quanta::fn::fold_loaded(
      ArgMin<T>{}, n,
      [=](int64_t u) {
        const int64_t j = lane + u * lanes;
        return bias ? bias[j] + row[j] : row[j];
      },
      [=](ArgMin<T> a, T v, int64_t u) {
        argmin_offer(a, v, c0 + lane + u * lanes);
        return a;
      });
}

/** The winning index; 0 when no score won (a row of only NaN or +inf). */
template <class T>
QUANTA_HD int64_t argmin_result(ArgMin<T> a) {
  return a.index == kNoIndex ? 0 : a.index;
}

// ---- commitment loss and the routes' backward ----

/** A squared error's element count at least 1: a count of 0 comes with a
 * sum of 0 (clamp(n, 1, NaN)'s value). */
QUANTA_HD inline double count_at_least_one(double n) { return n < 1.0 ? 1.0 : n; }

/** squared_error_mean: sums[0] / max(sums[1], 1), in f64. */
QUANTA_HD inline double squared_error_mean(const double* sums) {
  return sums[0] / count_at_least_one(sums[1]);
}

/** squared_error_coefficient: g scale / max(sums[1], 1), in the order of
 * the host formula it replaced (g * scale / n), in f64. */
QUANTA_HD inline double squared_error_coefficient(double g, double scale, const double* sums) {
  return g * scale / count_at_least_one(sums[1]);
}

/** squared_error_grad's element: scale (x - q). */
template <class T>
QUANTA_HD T commit_grad(T scale, T x, T q) {
  return scale * (x - q);
}

/** The straight-through route's element: g + cc (x - q). */
template <class T>
QUANTA_HD T straight_grad(T g, T cc, T x, T q) {
  return g + cc * (x - q);
}

// The rotation trick's backward (route_grad, rotation): the reference's
// safe_div clamps denominators at 1e-6; F.normalize (for w) at 1e-12.
inline constexpr double kRotationSafe = 1e-6;
inline constexpr double kRotationNormalizeEps = 1e-12;

/** max(a, b) as std::max: a when b is not larger (NaN b gives a). */
template <class T>
QUANTA_HD T max_of(T a, T b) {
  return a < b ? b : a;
}

/** A row's reciprocal norms from |x|^2 and |q|^2. */
template <class T>
struct RotationNorms {
  T ix, iq;
};
template <class T>
QUANTA_HD RotationNorms<T> rotation_norms(T xx, T qq) {
  return {T(1) / max_of<T>(std::sqrt(xx), T(kRotationSafe)),
          T(1) / max_of<T>(std::sqrt(qq), T(kRotationSafe))};
}

/** A row's coefficients of lambda (g - cw (u + q^) + cu u), from |q|^2, the
 * norms, |u + q^|^2 (ww), g.u (gu) and g.q^ (gq). */
template <class T>
struct RotationCoeffs {
  T lambda, cw, cu;
};
template <class T>
QUANTA_HD RotationCoeffs<T> rotation_coeffs(T qq, RotationNorms<T> nm, T ww, T gu, T gq) {
  const T iw = T(1) / max_of<T>(std::sqrt(ww), T(kRotationNormalizeEps));
  return {std::sqrt(qq) * nm.ix, T(2) * (gu + gq) * iw * iw, T(2) * gq};
}

/** One element of the rotation route's gradient plus cc (x - q). */
template <class T>
QUANTA_HD T rotation_grad(T x, T q, T g, RotationNorms<T> nm, RotationCoeffs<T> c, T cc) {
  const T u = x * nm.ix, qh = q * nm.iq;
  return c.lambda * (g - c.cw * (u + qh) + c.cu * u) + cc * (x - q);
}

// ---- LFQ's bit products ----

/** P(bit = 0) and P(bit = 1) of bit logit z: sigmoid(-z) and sigmoid(z),
 * each by the engine's sigmoid functor (accurate in its own tail; the CUDA
 * unary op's bits, an ulp or so from the CPU's, whose exp is Eigen's vector
 * form), into pi[0] and pi[1]. */
template <class T>
QUANTA_HD void bit_probabilities(T z, T* pi) {
  const quanta::fn::Sigmoid sigmoid{};
  pi[0] = sigmoid(-z);
  pi[1] = sigmoid(z);
}

/** dL/dz of one bit from dL/dpi (g0, g1) and its probabilities: (g1 - g0)
 * P(0) P(1), d sigmoid(z)/dz written with both tails' probabilities, so no
 * 1 - p cancels where p is near 1. */
template <class T>
QUANTA_HD T bit_probability_grad(T g0, T g1, T p0, T p1) {
  return (g1 - g0) * (p0 * p1);
}

/** Element c of the product distribution of k bits, pi [k, 2] (code bits
 * most significant first), multiplied in bit order as the CPU's in-place
 * build does, so the bits are the same. */
template <class T>
QUANTA_HD T bit_product_at(const T* pi, int64_t k, int64_t c) {
  T v = T(1);
  for (int64_t j = 0; j < k; ++j) v *= pi[2 * j + ((c >> (k - 1 - j)) & 1)];
  return v;
}

/** grad_pi[j, 0..1] of one row from gP [2^k]: the CPU's prefix-times-suffix
 * sums in the CPU's order, the prefix and suffix products made on the fly. */
template <class T>
QUANTA_HD void bit_product_grad_at(const T* pi, int64_t k, const T* gP, int64_t j, T* g2) {
  const int64_t n_hi = int64_t(1) << j, n_lo = int64_t(1) << (k - 1 - j);
  T g[2] = {T(0), T(0)};
  for (int64_t hi = 0; hi < n_hi; ++hi) {
    const T pre = bit_product_at(pi, j, hi);
    for (int64_t b = 0; b < 2; ++b) {
      const T* row = gP + (hi * 2 + b) * n_lo;
      T acc = T(0);
      for (int64_t lo = 0; lo < n_lo; ++lo)
        acc += row[lo] * bit_product_at(pi + 2 * (j + 1), k - 1 - j, lo);
      g[b] += acc * pre;
    }
  }
  g2[0] = g[0];
  g2[1] = g[1];
}

// ---- NF4 ----

/** The value of a 4-bit code: kNF4Values[code], read through a copy made at
 * compile time (device code may not index a namespace-scope constexpr array,
 * only use values computed from it in constant expressions). */
QUANTA_HD constexpr float nf4_value(int code) {
  constexpr std::array<float, 16> v = kNF4Values;
  return v[code & 15];
}

/** Midpoint i of the codes' values, float32((v[i] + v[i+1]) / 2), as
 * nf4_midpoints() has it. */
QUANTA_HD constexpr float nf4_midpoint(int i) { return (nf4_value(i) + nf4_value(i + 1)) / 2.0f; }

/** The code of a scaled value: the number of midpoints strictly below it
 * (NaN gives 0). */
QUANTA_HD inline int nf4_code(float scaled) {
  int c = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 15; ++i) c += scaled > nf4_midpoint(i) ? 1 : 0;
  return c;
}

/** Smallest stored scale: bitsandbytes clamps absmax to 1e-38 before taking
 * its reciprocal, so an all-zero block scales to 0 (code 7), not NaN. */
inline constexpr float kNF4MinScale = 1e-38f;

/** A block's divisor from its exact absmax. */
QUANTA_HD inline float nf4_block_scale(float absmax) { return max_of(absmax, kNF4MinScale); }

/** x scaled into [-1, 1] as bitsandbytes' reference does: full blocks
 * multiply by inv = 1 / a, the partial last block divides by a. */
QUANTA_HD inline float nf4_scaled(float x, float a, float inv, bool full) {
  const float v = full ? x * inv : x / a;
  return v < -1.0f ? -1.0f : (1.0f < v ? 1.0f : v);  // std::clamp: NaN stays NaN
}

/** The max-abs step of nf4_absmax: NaN ignored, as std::max(a, NaN) does. */
QUANTA_HD inline float nf4_absmax_step(float a, float x) { return max_of(a, std::fabs(x)); }

/** Code k of a run's packed bytes (high nibble = even element). */
QUANTA_HD inline int nf4_nibble(const uint8_t* codes, int64_t k) {
  const uint8_t byte = codes[k / 2];
  return k % 2 == 0 ? byte >> 4 : byte & 15;
}

/** Code j (0..7) of the 8 codes in `word`, 4 packed bytes read as one
 * little-endian 32-bit word (byte b = word bits 8b..8b+7; high nibble = even
 * element): what nf4_nibble gives for element j of those bytes. */
QUANTA_HD inline int nf4_word_code(uint32_t word, int j) {
  return static_cast<int>((word >> (8 * (j / 2) + 4 * (1 - j % 2))) & 15u);
}

/** The byte offsets of a word's 8 codes' f32 values in a table of the 16
 * (4 x nf4_word_code), four to a 32-bit value: byte b of `even` is code
 * 2 b's, byte b of `odd` code 2 b + 1's. Two shifts and two masks make all
 * 8, where a shift and a mask per code made each; one byte permute (PRMT)
 * then puts a byte into a 256-byte aligned table's address (the GEMV's
 * decode). */
struct NF4WordOffsets {
  uint32_t even = 0, odd = 0;
};
QUANTA_HD inline NF4WordOffsets nf4_word_offsets(uint32_t word) {
  return {(word >> 2) & 0x3c3c3c3cu, (word << 2) & 0x3c3c3c3cu};
}

/** The run of element i of w: i / w.run, as a shift for runs of 64 and 32
 * (every layout's), since a 64-bit division costs a GPU dozens of
 * instructions per element. */
QUANTA_HD inline int64_t nf4_run_of(const NF4Runs& w, int64_t i) {
  return w.run == 64 ? i >> 6 : w.run == 32 ? i >> 5 : i / w.run;
}

/** Codes of run r of w. */
QUANTA_HD inline const uint8_t* nf4_run_codes(const NF4Runs& w, int64_t r) {
  return w.codes + r * w.code_stride;
}

/** Where the f32 scale of run r of w is (the nf4 dtype's bytes: no alignment
 * promised). One run per scale, every unit's and block 32's or 64's case,
 * skips the 64-bit division. */
QUANTA_HD inline const uint8_t* nf4_run_scale_bytes(const NF4Runs& w, int64_t r) {
  return w.scales + (w.runs_per_scale == 1 ? r : r / w.runs_per_scale) * w.scale_stride;
}

/** The f32 scale of run r of w. */
QUANTA_HD inline float nf4_run_scale(const NF4Runs& w, int64_t r) {
  float s;
  memcpy(&s, nf4_run_scale_bytes(w, r), sizeof s);
  return s;
}

}  // namespace quanta::quant::fn
