#pragma once
// Random tensors and in-place random fills. The Generator is always passed
// explicitly (there is no global default). Every function validates first,
// then draws one slice of `gen`'s stream (generator.h: word i of a draw is
// philox(offset + i / 4, key)[i % 4], the offset then advances by
// ceil(words / 4)), so results depend only on (key, offset, shape, dtype) and
// a failed call leaves `gen` untouched. rand, randn, randint, bernoulli,
// uniform_ and normal_ compute on the target device (the kernel table's
// random_fill, one rule for every device: engine/random/draw.h), the rest on
// the CPU, moved to opts.device after. Which words feed which element is fixed below:
//
//   uniform, f32   element i <- word i:           (w >> 8) * 2^-24      [0, 1)
//            bf16  element i <- word i:           (w >> 24) * 2^-8      [0, 1)
//            f16   element i <- word i:           (w >> 21) * 2^-11     [0, 1)
//            f64   element i <- words 2i, 2i+1:   (((w[2i+1] << 32) | w[2i]) >> 11) * 2^-53
//   normal   Box-Muller on element pairs (2j, 2j+1); element 2j = r cos(t),
//            2j+1 = r sin(t), r = sqrt(-2 ln u1), t = 2 pi u2 (an odd last
//            element drops its sine).
//            f32 (and bf16/f16, rounded from f32): pair j <- words 2j, 2j+1;
//              u1 = (w[2j] + 1) * 2^-32 in (0, 1], u2 = w[2j+1] * 2^-32;
//              computed in f64, rounded to f32.
//            f64: pair j <- words 4j..4j+3; u1 = (x(4j, 4j+1) + 1) * 2^-53,
//              u2 = x(4j+2, 4j+3) * 2^-53 with x(a, b) = ((w[b] << 32) | w[a]) >> 11.
//            (Bits match another device whose libm log/sin/cos round alike;
//            the f32 path's f64 intermediate hides last-ulp differences.)
//   randint  element i <- x = (w[2i+1] << 32) | w[2i]; low + floor(x * r / 2^64)
//            with r = high - low (64-bit multiply-shift, no rejection): each
//            value's probability is off by at most 2^-64 from 1/r.
//   bernoulli element i <- word i: 1 if w * 2^-32 < p (exact: w < ceil(p 2^32)),
//            else 0; drawn in f32 for integer and bool dtypes, then converted.
#include <cstdint>
#include <utility>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta {

/** Uniform samples in [0, 1) (floating dtypes; mapping in the table above). */
Tensor rand(const Shape& shape, Generator& gen, const TensorOptions& opts = {});
/** Standard normal samples (Box-Muller, see above; floating dtypes). */
Tensor randn(const Shape& shape, Generator& gen, const TensorOptions& opts = {});
/** Uniform integers in [low, high) (needs low < high and both ends
 * representable in opts.dtype; i64 by default). */
Tensor randint(int64_t low, int64_t high, const Shape& shape, Generator& gen,
               const TensorOptions& opts = {.dtype = DType::i64});
/** A uniformly random permutation of 0..n-1 (i64): indices sorted by a
 * 64-bit key per index (words 2i, 2i+1), ties broken by index. On a device
 * the keys are drawn and sorted there (its table's sort_pairs), the same
 * permutation with no upload, so a captured step may draw it. */
Tensor randperm(int64_t n, Generator& gen, const TensorOptions& opts = {.dtype = DType::i64});
/** The first m entries of randperm(n, gen) (0 <= m <= n), bitwise, from the
 * same draws, in O(n log m) rather than a full sort: a random subset of m
 * distinct indices in random order. */
Tensor randperm_prefix(int64_t n, int64_t m, Generator& gen,
                       const TensorOptions& opts = {.dtype = DType::i64});
/** Indices (i64, on probs' device) drawn from the non-negative weights of
 * `probs` ([k] -> [num_samples], [rows, k] -> [rows, num_samples]).
 * With replacement: inverse CDF of one f64 uniform per sample (sample s of
 * row r uses words 2i, 2i+1 with i = r * num_samples + s). Without
 * replacement: exponential race (Gumbel-top-k): category j of row r gets
 * key ln(-ln u) - ln w with u in (0, 1] from words 2i, 2i+1, i = r * k + j;
 * the num_samples smallest keys in increasing order, so no index repeats.
 * Throws on negative, NaN or infinite weights, rows without positive weight,
 * and num_samples above the positive-weight categories without replacement. */
Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement, Generator& gen);
/** Bernoulli(p) samples as 0/1 in opts.dtype (f32 by default; bool works). */
Tensor bernoulli(const Shape& shape, double p, Generator& gen, const TensorOptions& opts = {});
/** bernoulli(shape, p, gen, opts) * value, drawing the same words (the same
 * positions are nonzero): in one pass for f32 and f64 (value rounded to the
 * dtype once), as that product for other floating dtypes. Dropout's scaled
 * keep-mask. */
Tensor scaled_bernoulli(const Shape& shape, double p, double value, Generator& gen,
                        const TensorOptions& opts = {});
/** x * scaled_bernoulli(x.shape(), p, value, gen, x's dtype and device),
 * the same draws and bits, in one pass that writes no mask where x is
 * contiguous f32 or f64 (else those two ops). No autograd: dropout's
 * building block. */
Tensor bernoulli_mul(const Tensor& x, double p, double value, Generator& gen);
/** {a * m, b * m} for the one mask m = scaled_bernoulli(a.shape(), p, value,
 * gen, a's dtype and device): bernoulli_mul(a, ...)'s draw and bits, and b
 * times the same mask, in one pass that writes no mask where a and b are
 * contiguous f32 or f64 (else the mask and two products). a and b share a
 * shape, dtype and device. No autograd: dropout's backward, which masks
 * its output gradient and its input alike. */
std::pair<Tensor, Tensor> bernoulli_mul_pair(const Tensor& a, const Tensor& b, double p,
                                             double value, Generator& gen);

struct RandomFill;  // engine/kernels/table.h

namespace detail {
/** The fill that bernoulli_mul(x, p, value, gen) draws for an x of this
 * shape, dtype (f32 or f64) and device, its words taken from gen as that
 * draw takes them (on a device capturing a graph, a stream slot each replay
 * rewrites): for a kernel that applies the mask itself, such as
 * dropout_linear's fused product (KernelTable::dropout_product). */
RandomFill taken_bernoulli_fill(const Shape& shape, double p, double value, DType dtype,
                                Generator& gen, Device device);
}  // namespace detail

/** Fills `t` in place with uniform values in [lo, hi): drawn as f64 for f64
 * tensors, else as f32 (then rounded to bf16/f16, which may reach hi). Any
 * floating dtype, any layout; refuses tensors that require grad while grad
 * mode is on. */
void uniform_(const Tensor& t, double lo, double hi, Generator& gen);
/** Fills `t` in place with normal(mean, std) values; dtypes and rules as
 * uniform_. */
void normal_(const Tensor& t, double mean, double std, Generator& gen);

}  // namespace quanta
