#pragma once
// The device seam: one table of kernels per device, one entry per kernel
// family (in the manner of ggml's backend vtable and candle's BackendStorage).
// Ops keep validation, dtype promotion, shape rules and the gradient rule,
// and call `kernels(device).<family>(...)` for the work. Entries take raw
// pointers, one shared shape, per-operand strides and dtypes; they never see
// a Tensor, so engine/cpu/ and engine/cuda/ know nothing of ops or autograd.
//
// Where a new op goes: its math as a functor in functors.h (and a row in the
// op list there) when it is elementwise, else a new family here with an entry
// in every device's table. Where a new device goes: a file that fills a
// KernelTable, and one case in kernels() (table.cpp).
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "engine/device.h"
#include "engine/device_error.h"
#include "engine/dtype.h"
#include "engine/kernels/conv_geom.h"
#include "engine/kernels/entries.h"
#include "engine/kernels/functors.h"
#include "engine/kernels/group_norm.h"
#include "engine/shape.h"

namespace quanta {

class Tensor;

/** One strided operand of an elementwise kernel: element i (a multi-index
 * over the kernel's shape) lives at data + sum(i[d] * strides[d]) elements.
 * A broadcast input has stride 0 along the broadcast dims. */
struct Operand {
  void* data = nullptr;
  DType dtype = DType::f32;
  const int64_t* strides = nullptr;  // one per dim of the kernel's shape
};

/** A strided matrix: element (i, j) at data + i * rs + j * cs elements. */
struct MatOperand {
  const void* data = nullptr;
  int64_t rs = 0;
  int64_t cs = 0;
};

/** `batch` products C_i = A_i B_i (or C_i += A_i B_i when `accumulate`):
 * A_i [m, k] starts at a_off[i] elements past a.data (all 0 when a_off is
 * null), likewise B_i [k, n]; C_i is row-major with row stride ldc and
 * starts at i * m * ldc. Operands satisfy the table's gemm_maps. */
struct GemmArgs {
  DType dtype = DType::f32;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  MatOperand a, b;
  const int64_t* a_off = nullptr;
  const int64_t* b_off = nullptr;
  void* c = nullptr;
  int64_t ldc = 0;
  bool accumulate = false;
  /** f32 products may round their operands to bf16 (f32 sums and result)
   * where the device multiplies bf16 faster: MixedPrecision's products
   * (engine/precision.h). Other dtypes ignore it. */
  bool bf16_products = false;
};

/** What a row reduction computes per row. */
enum class RowReduce : uint8_t {
  sum,
  prod,  // integers multiply as unsigned 64-bit (overflow wraps)
  max,   // NaN beats everything; needs inner >= 1
  min,
  all,  // bool rows
  any,
  logsumexp,  // max + log(sum(exp(x - max))); -inf for an empty row
};

/** A reduction's view of a contiguous tensor: [outer, a, keep, b], reduced
 * over a and b, the result [outer, keep]. Reducing the leading dims of
 * [rows, cols] is {1, rows, cols, 1}; NCHW over N, H and W is {1, N, C, H*W}. */
struct ReduceGrid {
  int64_t outer = 1, a = 1, keep = 1, b = 1;
};

/** A row reduction with one real parameter (floating rows only). */
enum class RowStat : uint8_t {
  var,   // sum((x - mean)^2) / param, param the divisor n - correction (>= 0)
  std,   // sqrt of var
  norm,  // (sum |x|^p)^(1/p) with p = param > 0; max |x| for p = INFINITY
};

/** What index_lines does along its dim. */
enum class IndexMode : uint8_t { gather, scatter_copy, scatter_fill, scatter_add };

/** What a random_fill draws per element (rules in engine/random/draw.h). */
enum class RandomDraw : uint8_t { uniform, normal, integer, bernoulli, bits };

/** One random fill: the stream (key, start block) and the value rule. */
struct RandomFill {
  RandomDraw draw = RandomDraw::uniform;
  DType dtype = DType::f32;  // uniform, bernoulli: f32, f64, bf16, f16; normal: f32, f64;
                             // integer: i64
  uint32_t key[2] = {0, 0};
  uint64_t start_lo = 0, start_hi = 0;  // the stream's first block
  bool affine = false;  // uniform, normal, bernoulli in f32 or f64: shift + scale * v
  double scale = 1.0, shift = 0.0;
  int64_t low = 0;     // integer: low + multiply-shift of the range
  uint64_t range = 0;  // integer: high - low, as unsigned (up to 2^64 - 1)
  uint64_t below = 0;  // bernoulli: 1 where the word < below (ceil(p 2^32)), else 0
  // bernoulli in f32 or f64: when set, n contiguous elements of the fill's
  // dtype on its device, and element i is times[i] * value (dropout in one
  // pass, no mask written). Null: the value itself.
  const void* times = nullptr;
  // With times set, a second product of the same draw: out2[i] = times2[i] *
  // the value element i of out was multiplied by (n contiguous elements of
  // the fill's dtype each; dropout's backward masks its output gradient and
  // its input with one mask). Null: none.
  const void* times2 = nullptr;
  void* out2 = nullptr;
  // When set, the stream is read from the fill's device when the kernel
  // runs, three words: key[0] | key[1] << 32, start_lo, start_hi (a
  // captured graph's draw, rewritten before each replay); key and start
  // above are then unused.
  const uint64_t* stream_at = nullptr;
};

/** Dropout fused with the product that follows it, as LoRA's first factor
 * runs it: element i of x [m, k] is kept as bernoulli fill `mask` keeps it
 * (its value, or 0; mask.times and out2 unused), xd = x * keep. Without
 * gt (the forward): t [m, r] = xd w^T. With gt
 * [m, r] (the backward): gx [m, k] = (gt w) * keep where gx is set (gx +=
 * with accumulate_gx: the sum of x's other gradients), and gw [r, k] =
 * gt^T xd where gw is set. x, w, t, gt, gx and gw are
 * contiguous, row-major, of mask.dtype (f32 or f64); k and r > 0. The CPU
 * fuses the steps for f32 with AVX-512 and for f64 (xd never stored; the
 * sums in an order set by the shapes alone, whatever the thread count);
 * other devices run them as engine/kernels/dropout_product_steps.h writes
 * them. */
struct DropoutProduct {
  RandomFill mask;
  int64_t m = 0, k = 0, r = 0;
  const void* x = nullptr;
  const void* w = nullptr;
  void* t = nullptr;
  const void* gt = nullptr;
  void* gx = nullptr;
  void* gw = nullptr;
  bool accumulate_gx = false;
  /** Where the device keeps them (KernelTable::dropout_keeps_bits; else
   * null): the keep-mask as bits, ceil(k / 16) 16-bit words a row of x, bit
   * j of word w of row i set when element (i, 16 w + j) is kept. The
   * forward writes them; the backward reads them instead of drawing the
   * stream's words again. */
  uint16_t* keep_bits = nullptr;
};

/** 16-bit words of DropoutProduct::keep_bits per row of k elements. */
inline int64_t keep_bit_words(int64_t k) { return (k + 15) / 16; }

/** One SGD step's settings (SGDOptions, plus whether the momentum buffer is
 * new: then it starts as the step's direction). */
struct SgdStep {
  double lr = 0, weight_decay = 0, momentum = 0, dampening = 0;
  bool nesterov = false;
  bool first = false;
  /** Or, in a captured step: device memory holding {lr, weight_decay},
   * read when the kernel runs (a graph rewrites it before each replay); lr
   * and weight_decay above are then unused. */
  const double* live = nullptr;
};

/** One Adam/AdamW step's settings; bias corrections for this step:
 * bc1 = 1 - beta1^t, bc2_sqrt = sqrt(1 - beta2^t). */
struct AdamStep {
  double lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
  double bc1 = 1, bc2_sqrt = 1;
  bool decoupled = false;  // AdamW: p *= 1 - lr wd, else g += wd p
  bool amsgrad = false;
  /** Or, in a captured step: device memory holding {lr, weight_decay, bc1,
   * bc2_sqrt}, read when the kernel runs (a graph rewrites it before each
   * replay); those four above are then unused. */
  const double* live = nullptr;
};

/** One parameter of a multi-tensor Adam step: its settings (each parameter
 * has its own step count, so its own bias corrections, and its group's lr)
 * and its n contiguous elements: param, grad, the moments and
 * max_exp_avg_sq (null without amsgrad), all of one dtype, on one device. */
struct AdamTensor {
  AdamStep s;
  int64_t n = 0;
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;
};

/** `count` parameters of one Adam step (the array itself is host memory). */
struct AdamTensorList {
  const AdamTensor* data = nullptr;
  int64_t count = 0;
};

/** n contiguous elements at data: a tensor of a multi-tensor entry
 * (scale_n writes it, norm_n reads it). */
struct TensorSpan {
  void* data = nullptr;
  int64_t n = 0;
};

/** `count` tensors of one multi-tensor call (the array itself is host
 * memory). */
struct TensorSpanList {
  const TensorSpan* data = nullptr;
  int64_t count = 0;
};

/** One block of copy_blocks: rows x cols contiguous elements at src, into
 * `rows` rows of dst whose starts lie dst_ld elements apart (dst_ld >=
 * cols). */
struct CopyBlock {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t rows = 0, cols = 0, dst_ld = 0;
};

/** `count` blocks of one copy_blocks call (the array itself is host
 * memory). */
struct CopyBlockList {
  const CopyBlock* data = nullptr;
  int64_t count = 0;
};

/** The terms of add_n: `count` pointers to arrays on the device (the array
 * of pointers itself is host memory). */
struct TermList {
  const void* const* data = nullptr;
  int64_t count = 0;
};

/** The kernels of one device. Every entry handles zero-size shapes. */
struct KernelTable {
  const char* device_name;
  /** True when gemm takes bf16 (gemm_bf16) or f16 (gemm_f16) operands and C
   * directly, multiplying and summing in f32 and rounding C once (as the f32
   * product of the widened operands does, up to the order of the sums); else
   * ops widen those operands to f32 first. */
  bool gemm_bf16;
  bool gemm_f16;
  /** True when unary, binary and update take bf16 and f16 operands directly
   * (all of one 16-bit dtype; a predicate's output bool), computing every
   * element in f32 and rounding the result once: the bits of widening the
   * operands to f32, the f32 kernel and narrowing, without those two passes
   * over memory. Else ops widen first. */
  bool half_elementwise;
  /** True when reduce_rows and reduce_grid take bf16 and f16 rows for sum,
   * max and min, reducing in f32 into f32 outputs (no widened copy of the
   * input; sums in the device's order). Else ops widen first. */
  bool half_reductions;
  /** True when dropout_product's forward writes DropoutProduct::keep_bits
   * and its backward reads them (the CPU's fused kernel: the backward then
   * draws nothing); else keep_bits must stay null. */
  bool dropout_keeps_bits;

  /** dst[i] = value converted to dst's dtype (any plain dtype). */
  void (*fill)(const Shape& shape, const Operand& dst, double value);
  /** dst[i] = src[i] converted (cast and strided copy; any plain dtypes). */
  void (*copy)(const Shape& shape, const Operand& dst, const Operand& src);
  /** out[i] = op(in[i]); out and in share a floating dtype (f32 or f64). */
  void (*unary)(UnaryOp op, const ScalarArgs& args, const Shape& shape, const Operand& out,
                const Operand& in);
  /** out[i] = op(a[i], b[i]); a and b share a numeric dtype, out has it too
   * (arithmetic) or is bool (predicates). */
  void (*binary)(BinaryOp op, const Shape& shape, const Operand& out, const Operand& a,
                 const Operand& b);
  /** dst[i] = op(dst[i], a[i], b[i]), all of dst's numeric dtype. */
  void (*update)(UpdateOp op, const ScalarArgs& args, const Shape& shape, const Operand& dst,
                 const Operand& a, const Operand& b);
  /** out[i] = cond[i] ? a[i] : b[i]; cond is bool, the rest share a dtype. */
  void (*where)(const Shape& shape, const Operand& out, const Operand& cond, const Operand& a,
                const Operand& b);
  /** out[i] = ((t0[i] + t1[i]) + t2[i]) + ... over the count >= 2 terms, in
   * that order, each term and out n contiguous elements of one dtype (f32 or
   * f64): the bits of adding the terms one by one, without the temporaries. */
  void (*add_n)(DType dtype, const TermList& terms, int64_t n, void* out);
  /** out[r] = reduce(rows[r, 0..inner)) for r < outer; rows contiguous, out
   * contiguous. sum: floating input reduces in its own dtype, integral into
   * i64. prod, max, min: out has the input's dtype (prod: f32, f64 or i64;
   * max, min: f32, f64, i32, i64, u8; inner >= 1). all, any: bool in and out.
   * logsumexp: f32 or f64. */
  void (*reduce_rows)(RowReduce op, DType in_dtype, const void* rows, int64_t outer, int64_t inner,
                      void* out);
  /** out[o * keep + k] = reduce over i < a, j < b of src[((o * a + i) * keep
   * + k) * b + j] (see ReduceGrid): a reduction over leading or middle dims
   * read in place, without the transposed copy reduce_rows would need. src
   * contiguous, ops and dtypes as reduce_rows' except logsumexp; max and min
   * need a, b >= 1. Each device sums in its own fixed order (deterministic,
   * possibly not reduce_rows' last bits). */
  void (*reduce_grid)(RowReduce op, DType in_dtype, const void* src, const ReduceGrid& grid,
                      void* out);
  /** True when a rows x cols matrix with strides (rs, cs) is a GEMM operand
   * this device takes without a copy. */
  bool (*gemm_maps)(int64_t rows, int64_t cols, int64_t rs, int64_t cs);
  /** Matrix products in f32 or f64 (see GemmArgs); bf16 and f16 too where
   * gemm_bf16 / gemm_f16 is set. */
  void (*gemm)(const GemmArgs& args);
  /** out[r] = stat(rows[r, 0..inner), param) for r < outer (see RowStat);
   * rows and out contiguous, of one dtype, f32 or f64; accumulation is in
   * that dtype (var, std) or in f64 (norm). */
  void (*stat_rows)(RowStat op, double param, DType dtype, const void* rows, int64_t outer,
                    int64_t inner, void* out);
  /** For r < outer, inner >= 1: indices[r] = the index of the first extremum
   * of rows[r, 0..inner) (op max or min; a NaN beats everything and the first
   * NaN wins; ties go to the first index), and values[r] = that element when
   * values is not null (the input's dtype: f32, f64, i32, i64 or u8). */
  void (*index_rows)(RowReduce op, DType dtype, const void* rows, int64_t outer, int64_t inner,
                     int64_t* indices, void* values);
  /** Running sums along n of a contiguous [outer, n, inner] block:
   * out[o, i, k] = sum of in[o, j, k] over j <= i (j >= i when reverse).
   * in and out share a dtype: f32, f64 or i64. */
  void (*cumsum)(DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner, bool reverse,
                 void* out);
  /** Softmax (log-softmax when `log`) along n of a contiguous
   * [outer, n, inner] block, stable (the line's max is subtracted first); a
   * line holding NaN or +inf, or only -inf, gives NaN. in and out share a
   * dtype: f32 or f64. */
  void (*softmax)(bool log, DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner,
                  void* out);

  // ---- the index family; indices are i64 on the same device, already
  // checked to lie in range by the op (or by checked_indices) ----

  /** out[a, j, :] = src[a, idx[j], :] for a contiguous src [outer, n, inner]
   * and out [outer, m, inner]; any plain dtype. */
  void (*index_select)(DType dtype, const void* src, int64_t outer, int64_t n, int64_t inner,
                       const int64_t* idx, int64_t m, void* out);
  /** Along dim `dim` of `shape` (the index's shape), for every line p (all
   * coordinates but dim) and j < shape[dim], with i = idx[p, j]:
   * gather: out[p, j] = src[p with i at dim]; scatter_copy / scatter_add:
   * out[p with i at dim] = (or +=) src[p, j]; scatter_fill: ... = value.
   * Each operand brings its own strides; out and src share a plain dtype
   * (numeric for scatter_add). Duplicate indices within a line are applied
   * in order, so results are deterministic. */
  void (*index_lines)(IndexMode mode, const Shape& shape, int64_t dim, const Operand& idx,
                      const Operand& out, const Operand& src, double value);
  /** out[a, idx[j], :] += alpha * src[a, j, :] for contiguous out
   * [outer, n, inner] and src [outer, m, inner] (numeric dtype), in order of
   * j, so duplicates are deterministic. */
  void (*index_add)(DType dtype, void* out, int64_t outer, int64_t n, int64_t inner,
                    const int64_t* idx, int64_t m, const void* src, double alpha);
  /** The bounds check of a device the host does not read (engine/
   * device_error.h): safe[i] = idx[i] when 0 <= idx[i] < size, else 0; a
   * bad index is recorded in *flag as {1, check, idx[i]} unless the flag is
   * already raised (on CUDA, whichever bad index wins; on sim the first).
   * Ops on the CPU check on the host instead and never call it (sim, which
   * queues the CPU's kernels, does). */
  void (*checked_indices)(const int64_t* idx, int64_t n, int64_t size, int64_t* safe,
                          DeviceErrorFlag* flag, int32_t check);

  // ---- convolution and pooling (geometry in engine/kernels/conv_geom.h);
  // every operand contiguous, f32 or f64 unless said otherwise ----

  /** One convolution kernel of `kind` over the sizes g; out need not be
   * initialised. forward: out [N, O, OH, OW] = conv2d(a = x [N, C, H, W],
   * b = w [O, C / groups, kh, kw]) + bias [O]. input_grad (conv_transpose2d):
   * out [N, C, H, W] = the adjoint of conv2d by b = w applied to
   * a = g [N, O, OH, OW], + bias [C]. weight_grad: out [O, C / groups, kh, kw]
   * = the weight gradient from a = x and b = g, summed over images (bias is
   * null). bias may be null (no bias). */
  void (*conv)(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
               const void* bias, void* out);
  /** Average pooling with divisor kernel[0] * kernel[1] (padding counts as
   * zeros; dilation is 1). Forward: out [P, OH, OW] = each window's sum of
   * in [P, H, W], times 1 / divisor. adjoint: out [P, H, W] = for every
   * element, the sum of in [P, OH, OW] * (1 / divisor) over the windows that
   * cover it, added in window order from 0. */
  void (*avg_pool)(bool adjoint, DType dtype, const PoolWindow& g, const void* in, void* out);
  /** Max pooling: out [P, OH, OW] = each window's maximum of in [P, H, W],
   * indices [P, OH, OW] (i64) = its flat position in the H x W plane: the
   * first maximum in window order (rows, then columns); a NaN beats
   * everything, and a later NaN beats an earlier one (the rule
   * `arg < 0 || v > best || isnan(v)`); -inf and -1 for a window that lies
   * wholly in the padding. */
  void (*max_pool)(DType dtype, const PoolWindow& g, const void* in, void* out, int64_t* indices);
  /** Values along max_pool's indices [P, OH, OW] (-1: none). gather:
   * out [P, OH, OW] = in [P, H, W] at the index (0 for -1). scatter:
   * out [P, H, W] = for every element, the sum of in [P, OH, OW] over the
   * outputs whose index it is, added in output order from 0 (deterministic). */
  void (*max_pool_route)(bool scatter, DType dtype, const PoolWindow& g, const int64_t* indices,
                         const void* in, void* out);
  /** Nearest 2x upsampling of `rows` rows of width W (planes stacked, any
   * plain dtype): out [2 rows, 2 W] with out[2r + a, 2j + b] = in[r, j]. */
  void (*upsample_nearest2x)(DType dtype, int64_t rows, int64_t W, const void* in, void* out);

  /** Squared distances from the products: with x [n, d] and c [k, d]
   * contiguous and out [n, k] holding x c^T, out[i, j] becomes
   * max(0, |x_i|^2 + |c_j|^2 - 2 out[i, j]). f32 or f64. */
  void (*sq_dist_finish)(DType dtype, const void* x, const void* c, int64_t n, int64_t k, int64_t d,
                         void* out);

  /** out[0..n) (contiguous) = the values of fill f: its stream's words
   * mapped by the rule of f.draw and f.dtype (engine/random/draw.h), so
   * every device gives the same bits (normal: the same within libm ulps).
   * The caller has taken draw::words(...) words from the generator. */
  void (*random_fill)(const RandomFill& f, int64_t n, void* out);
  /** One DropoutProduct (above): its mask drawn as random_fill draws
   * d.mask over m * k elements (the caller has taken those words from the
   * generator), so its keep is bernoulli_mul's. */
  void (*dropout_product)(const DropoutProduct& d);

  /** Stable ascending sort of n (key, value) pairs by key, each key's 64
   * bits read as unsigned: values_out[i] = the value of the i-th pair in key
   * order, pairs with equal keys in their input order. keys and values are
   * contiguous i64; values_out does not overlap them. */
  void (*sort_pairs)(int64_t n, const int64_t* keys, const int64_t* values, int64_t* values_out);

  /** One fused SGD step over n contiguous elements of one dtype (f32 or
   * f64): param, grad and momentum_buffer (null without momentum) updated
   * by fn::SgdUpdate (engine/kernels/optim_functors.h). */
  void (*sgd_step)(const SgdStep& s, DType dtype, int64_t n, void* param, const void* grad,
                   void* momentum_buffer);
  /** One fused Adam/AdamW step (fn::AdamUpdate) of every parameter in
   * `tensors` (f32 or f64, all of `dtype`): the bits of updating them one by
   * one, in fewer launches (on CUDA one per chunk of parameters). */
  void (*adam_step)(DType dtype, const AdamTensorList& tensors);
  /** x *= factor for every element of every tensor in `tensors`, all of
   * `dtype` (f32, f64, bf16 or f16; the 16-bit floats computed in f32 and
   * rounded once), factor one element of `dtype` on the device, read when
   * the kernel runs: gradient clipping's scaling of every gradient, the
   * bits of mul_ on each, in fewer launches (on CUDA one per chunk). */
  void (*scale_n)(DType dtype, const TensorSpanList& tensors, const void* factor);
  /** out[i] = the p-norm of tensors[i] (p > 0 or INFINITY; 0 for an empty
   * one) for every tensor, all of `dtype` (f32 or f64), out `count` f64
   * elements on the device: each value the bits stat_rows(RowStat::norm)
   * gives that tensor as one row, widened to f64, in fewer launches (on CUDA
   * one per chunk of tensors): gradient clipping's norms. */
  void (*norm_n)(DType dtype, double p, const TensorSpanList& tensors, double* out);
  /** Gradient clipping's total and factor from `count` per-tensor norms
   * (f64, on the device): *total = fn::clip_total, and *factor (one element
   * of factor_dtype: f32, f64, bf16 or f16) = fn::clip_factor(total,
   * max_norm) converted as copy converts an f64: the values of the chain of
   * reductions and scalar ops they replace, in one launch. */
  void (*clip_factor)(const double* norms, int64_t count, double p, double max_norm,
                      DType factor_dtype, double* total, void* factor);
  /** Every block of `blocks` copied as it is, elements of `dtype` (any
   * plain dtype), no destination overlapping a source or another block's
   * destination: cat's pieces in one call (on CUDA one launch per chunk of
   * blocks) where a copy each took a launch each. */
  void (*copy_blocks)(DType dtype, const CopyBlockList& blocks);

  /** Group normalisation (and layer normalisation, one group) of x in
   * geometry g (engine/kernels/group_norm.h), f32 or f64, every array
   * contiguous and of `dtype`: per group q, mean[q] and rstd[q] = 1 /
   * sqrt(biased variance + eps) (summed in f64 on the CPU, in the dtype by a
   * block on CUDA), and y = fn::norm_out of each element, with w[c] and
   * b[c] where not null. One pass of launches: the composed mean, variance
   * and affine ops took some eight. */
  void (*group_norm)(DType dtype, const NormGeom& g, double eps, const void* x, const void* w,
                     const void* b, void* y, void* mean, void* rstd);
  /** Its backward from group_norm's mean and rstd and the output gradient
   * gy: gx = fn::norm_grad_x of each element (gx += that with accumulate_gx:
   * the sum of x's other gradients), gw[c] = the sum of gy xhat and gb[c] =
   * the sum of gy over the batch and spatial positions of channel c, in a
   * fixed order per device. gx, gw and gb may each be null (not wanted). */
  void (*group_norm_grad)(DType dtype, const NormGeom& g, const void* x, const void* w,
                          const void* mean, const void* rstd, const void* gy, void* gx, void* gw,
                          void* gb, bool accumulate_gx);
};

/** Every function entry of KernelTable, in the table's order. Each device's
 * table and the declarations of its entries are made from this list
 * (engine/cpu/table.cpp, engine/cuda/table.cu, engine/sim/sim_kernels.cpp),
 * so a new kernel family is its member above, its name here, and a function
 * of that name in each device's folder. */
// (An X-macro list, which clang-format does not lay out idempotently.)
// clang-format off
#define QUANTA_KERNEL_ENTRIES(X) \
  X(fill) X(copy) X(unary) X(binary) X(update) X(where) X(add_n) X(reduce_rows) X(reduce_grid) \
  X(gemm_maps) X(gemm) X(stat_rows) X(index_rows) X(cumsum) X(softmax) X(index_select) \
  X(index_lines) X(index_add) X(checked_indices) X(conv) X(avg_pool) X(max_pool) \
  X(max_pool_route) X(upsample_nearest2x) X(sq_dist_finish) X(random_fill) X(dropout_product) \
  X(sort_pairs) X(sgd_step) X(adam_step) X(scale_n) X(norm_n) X(clip_factor) X(copy_blocks) \
  X(group_norm) X(group_norm_grad)
// clang-format on

/** Declares a device's function for `entry`, with the entry's type (in the
 * device's namespace): QUANTA_KERNEL_ENTRIES(QUANTA_DECLARE_KERNEL). */
#define QUANTA_DECLARE_KERNEL(entry) QUANTA_DECLARE_ENTRY(KernelTable, entry)

QUANTA_CHECK_ENTRY_LIST(KernelTable, QUANTA_KERNEL_ENTRIES, 2);

/** The kernel table of `device`; for CUDA in a build without CUDA, a table
 * whose every entry throws "[op] quanta was built without CUDA". */
const KernelTable& kernels(Device device);

/** The device all of `ts`' defined tensors live on (cpu when none is
 * defined); throws naming `op` and both devices when they differ. */
Device common_device(const char* op, std::initializer_list<const Tensor*> ts);

/** The table of common_device(op, ts). */
const KernelTable& kernels_for(const char* op, std::initializer_list<const Tensor*> ts);

/** The operand view of a tensor: its data (on its device), dtype, strides. */
Operand operand_of(const Tensor& t);

/** Name of an elementwise op, for errors ("exp", "add", "addcmul"). */
const char* op_name(UnaryOp op);
const char* op_name(BinaryOp op);
const char* op_name(UpdateOp op);
/** Name of a row reduction, for errors ("sum", "max", "logsumexp"). */
constexpr const char* op_name(RowReduce op) {
  constexpr const char* names[] = {"sum", "prod", "max", "min", "all", "any", "logsumexp"};
  return names[static_cast<int>(op)];
}
constexpr const char* op_name(RowStat op) {
  constexpr const char* names[] = {"var", "std", "norm"};
  return names[static_cast<int>(op)];
}

namespace cpu {
/** The CPU table (engine/cpu/). */
const KernelTable& cpu_kernels();
}  // namespace cpu
namespace sim {
/** The sim table: the CPU's kernels queued on the current sim device's
 * stream (engine/sim/sim_kernels.cpp). */
const KernelTable& sim_kernels();
}  // namespace sim
namespace cuda {
/** The CUDA table (engine/cuda/kernels.cu, inside libquanta_cuda). */
const KernelTable& cuda_kernels();
/** The table used when there is no CUDA backend: every entry throws naming
 * its op and why (engine/cuda/unavailable.cpp). */
const KernelTable& unavailable_kernels();
}  // namespace cuda

}  // namespace quanta
