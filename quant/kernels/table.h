#pragma once
// The quantizers' device seam, in the manner of the engine's (engine/kernels/
// table.h): one table of kernels per device, one entry per fast path that is
// a hand-written loop rather than a composition of engine ops. The quantizer
// ops (quant/vq, quant/scalar, quant/nf4) keep validation, shapes, dtype rules
// and the gradient rule, create their outputs on the input's device and call
// `quant_kernels(device).<entry>(...)` for the work. Entries take raw
// pointers (on that device), sizes and dtypes; they never see a Tensor, so
// quant/cpu/ and quant/cuda/ know nothing of the layers, ops or autograd.
//
// Paths composed of engine ops (FSQ and LFQ quantize and their straight-
// through backward, the codebook EMA lerps, k-means' updates, the LFQ batch
// entropy's GEMM) need no entry: they run on every device the engine's table
// serves.
//
// Where a new fast path goes: an entry here with its contract and its name
// in QUANTA_QUANT_KERNEL_ENTRIES, one function of that name in quant/cpu/,
// one in quant/cuda/, and its line in quant/cuda/unavailable.cpp. A device
// the table lacks fails in one place, its entry, naming the op.
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/kernels/entries.h"
#include "quant/kernels/nf4_layout.h"

namespace quanta {
class Tensor;
}

namespace quanta::quant {

/** LFQ's entropy clamp (the reference's): entropies use
 * log(max(p, kEntropyEps)). */
inline constexpr double kEntropyEps = 1e-5;

/** nf4_linear's f32 input rounded to bf16 (to nearest even), [m, k] on the
 * device, shared by the products of one input (SharedBf16Input). With
 * `write`, the kernel rounds x into `data` whether or not it multiplies in
 * bf16 (the products after it read what it wrote); without, `data` (when
 * set) already holds it, and a kernel that multiplies in bf16 reads it
 * instead of rounding x. Null data: the kernel rounds x itself, if at all. */
struct Bf16Input {
  void* data = nullptr;
  bool write = false;
};

/** The quantizer kernels of one device. Every entry handles zero sizes. Row
 * masks (`valid`) are u8 0/1 per row, or null (every row counts). */
struct QuantKernelTable {
  const char* device_name;

  // ---- vector quantization (quant/vq) ----

  /** nearest_codes: out[i] = the index of the row of codes [k, d] nearest to
   * row i of x [n, d] (smallest |x - c|^2, or with `cosine` the largest x.c);
   * ties go to the first index, NaN scores never win (a row of only NaN gives
   * 0). x and codes contiguous, both of `dtype` (f32 or f64); k >= 1. */
  void (*nearest_codes)(DType dtype, const void* x, const void* codes, int64_t n, int64_t k,
                        int64_t d, bool cosine, int64_t* out);
  /** commitment_loss (and route_with_commitment) forward: over x, q [rows, d]
   * (contiguous, `dtype` f32 or f64), out[0] = the sum of (x - q)^2 over the
   * rows with valid[r] != 0, in f64 partial sums of 256 rows added in order
   * (the total does not depend on the thread count), and out[1] = the number
   * of such elements (the sum of valid, or rows, times d). `out` is two f64
   * on the device: the loss never visits the host. */
  void (*squared_error)(DType dtype, const void* x, const void* q, const uint8_t* valid,
                        int64_t rows, int64_t d, double* out);
  /** The loss squared_error's sums give: *mean (one element of `dtype`, f32
   * or f64) = T(sums[0] / max(sums[1], 1)) (fn::squared_error_mean), the
   * bits of the composed ops it replaces (a clamp, a division, a cast). */
  void (*squared_error_mean)(DType dtype, const double* sums, void* mean);
  /** The backward's coefficient of (x - q): *coef = f64(*g) * scale /
   * max(sums[1], 1) (fn::squared_error_coefficient), g one element of
   * `g_dtype` (f32 or f64), all on the device. */
  void (*squared_error_coefficient)(DType g_dtype, const void* g, double scale, const double* sums,
                                    double* coef);
  /** commitment_loss backward: gx [rows, d] = T(*scale) * (x - q), exactly 0
   * on rows with valid[r] == 0, `scale` one f64 on the device. Every element
   * of gx is written. */
  void (*squared_error_grad)(DType dtype, const void* x, const void* q, const uint8_t* valid,
                             int64_t rows, int64_t d, const double* scale, void* gx);
  /** rotate_to / route_with_commitment backward: x's gradient from the
   * output gradient g along the route (rotation: the rotation trick's
   * lambda (g - 2 (g.w) w + 2 (g.q^) u), u = x/|x|, q^ = q/|q|,
   * w = (u + q^)/|u + q^|, lambda = |q|/|x|; else g itself) plus
   * T(coef) * T(valid[r]) * (x - q) (valid null: T(coef) (x - q)), `coef`
   * one f64 on the device or null (no commitment term). x, q, g and gx
   * [rows, d] contiguous, of `dtype` (f32 or f64). */
  void (*route_grad)(bool rotation, DType dtype, const void* x, const void* q, const void* g,
                     const uint8_t* valid, const double* coef, int64_t rows, int64_t d, void* gx);
  /** Dead-code replacement's choice for one table of k codes, on the device:
   * picks[c] = draws[j] for the j-th code (ascending) whose cluster_size[c]
   * < T(threshold), -1 for the others. draws [k] i64 (a permutation prefix
   * of a pool of at least k rows, so every expired code has one);
   * cluster_size [k] of `dtype` (f32 or f64). What lt, cumsum, gather and
   * where gave in six launches. */
  void (*dead_code_picks)(DType dtype, const void* cluster_size, int64_t k, double threshold,
                          const int64_t* draws, int64_t* picks);
  /** Dead-code replacement's writes for one table of k codes of d elements,
   * in place: for each c with picks[c] >= 0, the source row s = src row
   * (gather ? picks[c] : c) (src contiguous rows of d, `dtype` f32 or f64)
   * goes to embed row c as T(1) * s, to embed_avg row c as T(threshold) * s,
   * and cluster_size[c] = T(threshold), the three tables in one launch
   * (three row writes and a where before); other codes are not touched. */
  void (*replace_codes)(DType dtype, int64_t k, int64_t d, const int64_t* picks, bool gather,
                        const void* src, double threshold, void* embed, void* embed_avg,
                        void* cluster_size);
  /** The statistics of an assignment (the codebook EMA's and k-means'):
   * counts[c] = the number of rows i with idx[i] == c, and row c of sums
   * [k, d] = the sum of those rows of x [n, d], for every c in [0, k) (0 for
   * unused codes); an idx outside [0, k) counts nowhere. x, counts and sums
   * contiguous, of `dtype` (f32 or f64); idx i64 on the device. The same
   * bits on every run: the CPU adds each code's rows in row order (what
   * index_add gives); CUDA sorts the rows by code, stably, and adds fixed
   * pieces of each code's rows, then the pieces in order (quant/cuda/
   * plans.h: code_stats_piece_rows), so no float atomics decide the order. */
  void (*code_statistics)(DType dtype, const int64_t* idx, const void* x, int64_t n, int64_t k,
                          int64_t d, void* counts, void* sums);
  /** The codebook EMA's lerp, in place: x = x keep + alpha a over n
   * contiguous elements of `dtype` (f32 or f64), the bits of mul_(x, keep)
   * then add_(x, a, alpha) (fn::ema_lerp) in one pass: cluster_size's and
   * embed_avg's updates. */
  void (*ema_lerp)(DType dtype, int64_t n, double keep, double alpha, void* x, const void* a);
  /** The codebook from its EMA statistics with Laplace smoothing: for t <
   * tables and c < k, embed[t, c, :] = embed_avg[t, c, :] / ((cluster_size[t,
   * c] + eps) / (totals[t] + k eps) totals[t]) (fn::smoothed_size, the bits
   * of the composed ops), totals[t] the sum of cluster_size's row t. All
   * contiguous, of `dtype` (f32 or f64). One pass where the ops took six. */
  void (*ema_embed)(DType dtype, int64_t tables, int64_t k, int64_t d, double eps,
                    const void* cluster_size, const void* totals, const void* embed_avg,
                    void* embed);

  // ---- LFQ entropy (quant/scalar/lfq_entropy.cpp) ----

  /** LFQ's bit probabilities: pi [rows, k, 2] = (P(0), P(1)) of z's
   * columns [begin, begin + k) (fn::bit_probabilities: the engine's
   * sigmoid functor of -z and z), z [rows, d] and pi contiguous, `dtype` f32 or
   * f64: bit_product's input in one launch, where a negation, two sigmoids,
   * a stacking copy and the slice's copy took five. */
  void (*bit_probabilities)(DType dtype, const void* z, int64_t rows, int64_t d, int64_t begin,
                            int64_t k, void* pi);
  /** Its backward: dz[r, begin + j] = fn::bit_probability_grad of g[r, j]
   * (g [rows, k, 2] contiguous) for j < k; dz's other columns are not
   * touched, so two calls over disjoint columns fill one buffer. */
  void (*bit_probabilities_grad)(DType dtype, const void* z, const void* g, int64_t rows, int64_t d,
                                 int64_t begin, int64_t k, void* dz);
  /** bit_product_distribution: out [rows, 2^k] = the product distributions
   * of pi [rows, k, 2] (P(0), P(1) per bit; code index bits most significant
   * first), contiguous, `dtype` f32 or f64. */
  void (*bit_product)(DType dtype, const void* pi, int64_t rows, int64_t k, void* out);
  /** Its backward: grad_pi [rows, k, 2] from grad_out [rows, 2^k] (prefix
   * times suffix products, no division). */
  void (*bit_product_grad)(DType dtype, const void* pi, const void* grad_out, int64_t rows,
                           int64_t k, void* grad_pi);
  /** clamped_bit_product_entropy in f64: h[r] = H_eps of the product
   * distribution with bit logits z [rows, d], grad [rows, d] = dh[r]/dz. */
  void (*clamped_entropy)(const double* z, int64_t rows, int64_t d, double* h, double* grad);

  // ---- NF4 (quant/nf4) ----

  /** absmax[b] = the max |x| of block b of `block` elements of x [n] (f32;
   * NaN ignored), for the ceil(n / block) blocks. */
  void (*nf4_absmax)(const float* x, int64_t n, int64_t block, float* absmax);
  /** Writes the codes of x [n] (f32) in blocks of `block` (32, 64, 128 or
   * 256; a multiple of out.run, which is 32 or 64) as bitsandbytes'
   * reference computes them from the exact absmax [blocks], and, when
   * out.scales is set, stored[block of run] as every run's scale. n >= 1. */
  void (*nf4_encode)(const float* x, int64_t n, int64_t block, const float* absmax,
                     const float* stored, const NF4RunsOut& out);
  /** All w.n elements into out, an array of `dtype` (f32, bf16 or f16):
   * dtype(float32(value(code) * scale)). */
  void (*nf4_decode)(const NF4Runs& w, DType dtype, void* out);
  /** nf4_linear: y [m, n] = x [m, k] W^T (+ bias [n] when not null), W the
   * [n, k] weight of w with values dequant(value * scale) (f32, bf16 or f16);
   * x, bias and y contiguous of `dtype` (f32 or f64); xb only with f32. */
  void (*nf4_linear)(DType dtype, const void* x, int64_t m, int64_t k, const NF4Runs& w,
                     DType dequant, int64_t n, const void* bias, void* y, Bf16Input xb);
  /** Its input gradient: dx [m, k] = g [m, n] W, or dx += g W when
   * `accumulate` (the sum of the input's other gradients), contiguous, of
   * `dtype`. */
  void (*nf4_linear_grad)(DType dtype, const void* g, int64_t m, int64_t n, const NF4Runs& w,
                          DType dequant, int64_t k, void* dx, bool accumulate);
};

/** Every function entry of QuantKernelTable, in the table's order. Each
 * device's table and the declarations of its entries are made from this list
 * (quant/cpu/table.cpp, quant/cuda/table.cu, quant/sim/table.cpp), as the
 * engine's are from QUANTA_KERNEL_ENTRIES: a new family is its member above,
 * its name here, and a function of that name in each device's folder. */
// clang-format off
#define QUANTA_QUANT_KERNEL_ENTRIES(X) \
  X(nearest_codes) X(squared_error) X(squared_error_mean) X(squared_error_coefficient) \
  X(squared_error_grad) X(route_grad) X(dead_code_picks) X(replace_codes) \
  X(code_statistics) X(ema_lerp) X(ema_embed) X(bit_probabilities) X(bit_probabilities_grad) X(bit_product) X(bit_product_grad) X(clamped_entropy) X(nf4_absmax) \
  X(nf4_encode) X(nf4_decode) X(nf4_linear) X(nf4_linear_grad)
// clang-format on

/** Declares a device's function for `entry`, with the entry's type (in the
 * device's namespace): QUANTA_QUANT_KERNEL_ENTRIES(QUANTA_DECLARE_QUANT_KERNEL). */
#define QUANTA_DECLARE_QUANT_KERNEL(entry) QUANTA_DECLARE_ENTRY(QuantKernelTable, entry)

QUANTA_CHECK_ENTRY_LIST(QuantKernelTable, QUANTA_QUANT_KERNEL_ENTRIES, 1);

/** The quantizer kernel table of `device`: the CPU table (quant/cpu/), sim's
 * (quant/sim/), or for CUDA the CUDA module's (quant/cuda/), with the device made current; without
 * the module, a table whose entries throw "[op] has no CUDA kernel here: why". */
const QuantKernelTable& quant_kernels(Device device);

/** The table of the device that all of `ts`' defined tensors live on; throws
 * std::invalid_argument naming `op` and both devices when they differ. */
const QuantKernelTable& quant_kernels_for(const char* op, std::initializer_list<const Tensor*> ts);

namespace quant_cpu {
/** The CPU table (quant/cpu/table.cpp). */
const QuantKernelTable& table();
}  // namespace quant_cpu
namespace quant_sim {
/** The sim table: the CPU's entries queued on the current sim device's
 * stream (quant/sim/table.cpp). */
const QuantKernelTable& table();
}  // namespace quant_sim
namespace quant_cuda {
/** The CUDA table: the CUDA module's (quant/cuda/table.cu), or
 * unavailable_table() in a build without CUDA or where the module cannot be
 * loaded (quant/cuda/unavailable.cpp). */
const QuantKernelTable& table();
/** The table whose entries all throw std::runtime_error naming the op and why
 * the CUDA module's table cannot be had. */
const QuantKernelTable& unavailable_table();
}  // namespace quant_cuda

}  // namespace quanta::quant
