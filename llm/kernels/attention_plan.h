#pragma once
// Scaled dot-product attention as whole-matrix products over chunks of
// heads, for a device whose strength is a library GEMM (CUDA: cuBLAS)
// rather than a hand-tiled kernel. Per chunk the heads are
// gathered into contiguous scratch in the accumulation dtype, each head's
// scores [q_len, kv_len] are one product, a row pass turns them into
// probabilities (and the log-sum-exp the backward reads), and the output is
// a second product; the backward recomputes the probabilities from the
// log-sum-exp and runs the five products FlashAttention-2 runs per block,
// once per head. Memory is the chunk's scores, bounded by a budget, not the
// whole q_len x kv_len x heads.
//
// The plan is host code over an executor, so the order of the steps, the
// chunking, the grouped-query expansion and every stride are tested on the
// CPU with an executor of plain loops against the CPU's attention kernels
// (tests/llm/kernels/test_attention_plan.cpp); the CUDA executor
// (llm/cuda/attention_products.cu) is thin: gathers, a row pass each way, cuBLAS.
//
// Layout of a chunk of `pairs` (image, kv head) pairs, pair p = b * kv_heads
// + hk, each with its `group` = heads / kv_heads query heads h = hk * group
// + g: query-side buffers (q, o, dq: [t = q_len, d]; s, ds: [q_len, kv_len])
// hold one slot per query head, slot = local pair * group + g; key-side
// buffers (k, v, dk, dv: [kv_len, d]) one per pair, shared by its group.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/kernels/functors.h"  // QUANTA_HD
#include "llm/kernels/functors.h"
#include "llm/kernels/table.h"

namespace quanta::llm::attention_plan {

/** The score of key j for query i of image b, query head h, from the raw
 * product q.k: scale * q.k (soft-capped when a.softcap is set) + mask, or
 * -inf where the causal mask or the sliding window hides j (CUDA's
 * reference kernels use it too; a block's products skip the keys before
 * its first row's window, and every hidden key's probability is 0).
 * `slope`, when given, receives d score / d (scale q.k): the cap's 1 -
 * tanh^2, else 1. */
template <class A>
QUANTA_HD inline A row_score(const AttentionArgs& a, A raw, int64_t b, int64_t h, int64_t i,
                             int64_t j, A* slope = nullptr) {
  if (slope) *slope = A(1);
  if (a.causal && (j > fn::last_visible_key(i, a.q_len, a.kv_len) ||
                   j < fn::first_visible_key(i, a.q_len, a.kv_len, a.window)))
    return A(-INFINITY);
  A s = raw * static_cast<A>(a.scale);
  if (a.softcap > 0) {
    const A cap = static_cast<A>(a.softcap), t = fn::softcap_tanh(s, cap);
    s = cap * t;
    if (slope) *slope = fn::softcap_slope(t);
  }
  const MaskOperand& m = a.mask;
  if (m.data) s += static_cast<const A*>(m.data)[b * m.sb + h * m.sh + i * m.si + j * m.sj];
  return s;
}

/** A row's log-sum-exp from its largest score and its sum of exp(score -
 * max): -inf for a row that sees no key. */
template <class A>
QUANTA_HD inline A row_lse(A max, A sum) {
  return sum > A(0) ? max + std::log(sum) : A(-INFINITY);
}

/** exp(score - max) for the row's sum, 0 for a hidden key. */
template <class A>
QUANTA_HD inline A row_term(A score, A max) {
  return score == A(-INFINITY) ? A(0) : std::exp(score - max);
}

/** A probability from its score and its row's log-sum-exp (0 for a hidden
 * key, and for every key of a row that sees none). */
template <class A>
QUANTA_HD inline A row_prob(A score, A lse) {
  return fn::attention_prob(score, lse);
}

/** The score gradient the products take: scale * slope * p (dp - delta),
 * the scale of q.k (and soft-capping's slope, row_score's) folded in once
 * for dq and dk; 0 where p is 0. */
template <class A>
QUANTA_HD inline A row_score_grad(const AttentionArgs& a, A p, A dp, A delta, A slope = A(1)) {
  // p = 0: a hidden key, whose dp a causal block's product did not write.
  return p == A(0) ? A(0)
                   : static_cast<A>(a.scale) * slope * fn::attention_score_grad(p, dp, delta);
}

/** The scratch buffers of a chunk, in the accumulation dtype. */
enum class Buf : uint8_t { q, k, v, o, s, ds, dq, dk, dv };

/** A batch of matrices in one buffer: matrix i element (r, c) at
 * offset + i * stride + r * rs + c * cs (one of rs, cs is 1). */
struct Mats {
  Buf buf;
  int64_t offset, stride, rs, cs;
};

/** batch products C_i = A_i B_i, C_i [m, n] (C += when accumulate). */
struct Product {
  int64_t batch, m, n, k;
  Mats a, b, c;
  bool accumulate;
};

/** One chunk: pairs [first, first + count). */
struct Chunk {
  int64_t first, count;
};

/** The sizes the plan works in. */
struct Dims {
  int64_t tq, tk, d, group, kv_heads;
  explicit Dims(const AttentionArgs& a)
      : tq(a.q_len),
        tk(a.kv_len),
        d(a.head_dim),
        group(a.kv_heads > 0 ? a.heads / a.kv_heads : 1),
        kv_heads(a.kv_heads) {}
  /** Elements of buffer `b` per pair (a query-side buffer holds group slots). */
  int64_t per_pair(Buf b) const {
    switch (b) {
      case Buf::q:
      case Buf::o:
      case Buf::dq:
        return group * tq * d;
      case Buf::s:
      case Buf::ds:
        return group * tq * tk;
      default:
        return tk * d;
    }
  }
  /** Scratch elements per pair, forward (q, k, v, o, s) or backward (all). */
  int64_t scratch_per_pair(bool backward) const {
    int64_t n = per_pair(Buf::q) + per_pair(Buf::k) + per_pair(Buf::v) + per_pair(Buf::o) +
                per_pair(Buf::s);
    if (backward)
      n += per_pair(Buf::ds) + per_pair(Buf::dq) + per_pair(Buf::dk) + per_pair(Buf::dv);
    return n;
  }
};

/** Pairs per chunk so that a chunk's scratch stays within `budget`
 * elements: at least 1 (a caller checks that one pair fits first), at most
 * every pair. */
inline int64_t pairs_per_chunk(const AttentionArgs& a, bool backward, int64_t budget) {
  const Dims dims(a);
  const int64_t pairs = a.batch * a.kv_heads;
  const int64_t per = std::max<int64_t>(dims.scratch_per_pair(backward), 1);
  return std::clamp<int64_t>(budget / per, 1, std::max<int64_t>(pairs, 1));
}

// Key-side matrices, rows [first_row, ..) of [rows, cols], one per pair
// (transposed: their transposes).
inline Mats pairs_of(Buf b, int64_t rows, int64_t cols, bool transposed, int64_t first_row = 0) {
  return {b, first_row * cols, rows * cols, transposed ? 1 : cols, transposed ? cols : 1};
}

/** Query rows per block of the products: under a causal mask a block
 * multiplies only the keys its last row sees (at T 512, 5/8 of the whole
 * products; at T 2048, 17/32). */
inline constexpr int64_t kQueryBlock = 128;

/** A block of query rows [first, first + rows) and the keys [key_first,
 * key_first + keys) its products take: every key a row of it sees (at
 * least one: a row that sees none takes one hidden key, whose probability
 * is 0). */
struct QueryBlock {
  int64_t first, rows, key_first, keys;
};

/** The blocks in the order the products run, the last first: it takes
 * every key from 0, so the first product into dk and dv writes all their
 * rows and the rest add. Under a sliding window every other block starts
 * at the first key its first row sees (with a window of 1024 over 8192
 * tokens, a block's products take 1151 keys instead of up to 8192). Without
 * a causal mask, one block of every row. */
inline std::vector<QueryBlock> query_blocks(const AttentionArgs& a) {
  if (!a.causal) return {{0, a.q_len, 0, a.kv_len}};
  std::vector<QueryBlock> out;
  for (int64_t first = (a.q_len - 1) / kQueryBlock * kQueryBlock; first >= 0;
       first -= kQueryBlock) {
    const int64_t rows = std::min(kQueryBlock, a.q_len - first);
    const int64_t seen = std::clamp<int64_t>(
        fn::last_visible_key(first + rows - 1, a.q_len, a.kv_len) + 1, 1, a.kv_len);
    const int64_t from =
        out.empty() ? 0
                    : std::clamp<int64_t>(fn::first_visible_key(first, a.q_len, a.kv_len, a.window),
                                          0, seen - 1);
    out.push_back({first, rows, from, seen - from});
  }
  return out;
}

// Query-side matrices of block qb for query head g of every pair in the
// chunk (slots `group` apart): rows [qb.first, ..) of a buffer whose rows
// are `width` wide, from column `first_col` (transposed: their transposes).
inline Mats block_rows(const Dims& x, Buf b, int64_t g, const QueryBlock& qb, int64_t width,
                       bool transposed, int64_t first_col = 0) {
  const int64_t size = x.tq * width;
  return {b, g * size + qb.first * width + first_col, x.group * size, transposed ? 1 : width,
          transposed ? width : 1};
}

// A block's scores (s or ds): its rows, from its first key.
inline Mats block_scores(const Dims& x, Buf b, int64_t g, const QueryBlock& qb, bool transposed) {
  return block_rows(x, b, g, qb, x.tk, transposed, qb.key_first);
}

// A pair's key-side rows (k, v, dk, dv) a block's products take.
inline Mats block_keys(const Dims& x, Buf b, const QueryBlock& qb, bool transposed) {
  return pairs_of(b, x.tk, x.d, transposed, qb.key_first);
}

// Each chunk of the pairs, in order: its scratch, its heads gathered (and
// the output gradient, for the backward), its raw scores s = q k^T block by
// block; then rest(chunk).
template <class Exec, class Rest>
void for_chunks(const AttentionArgs& a, int64_t chunk_pairs, const std::vector<QueryBlock>& blocks,
                bool backward, Exec& exec, Rest&& rest) {
  const Dims x(a);
  const int64_t pairs = a.batch * a.kv_heads;
  for (int64_t first = 0; first < pairs; first += chunk_pairs) {
    const Chunk c{first, std::min(chunk_pairs, pairs - first)};
    exec.begin_chunk(c);
    exec.gather(c, Buf::q);
    exec.gather(c, Buf::k);
    exec.gather(c, Buf::v);
    if (backward) exec.gather(c, Buf::o);  // the output gradient
    for (int64_t g = 0; g < x.group; ++g)
      for (const QueryBlock& qb : blocks)
        exec.product({c.count, qb.rows, qb.keys, x.d, block_rows(x, Buf::q, g, qb, x.d, false),
                      block_keys(x, Buf::k, qb, true), block_scores(x, Buf::s, g, qb, false),
                      false});
    rest(c);
  }
}

/** The forward: out and lse of every query (AttentionArgs). Exec provides
 * begin_chunk(chunk) (scratch for it), gather(chunk, which) for Buf::q
 * (a.q per slot), Buf::k, Buf::v (per pair), product(Product),
 * softmax_rows(chunk) (s: raw q.k in where a block's products wrote it,
 * probabilities out for every key, lse written) and scatter_out(chunk) (o
 * into a.out). */
template <class Exec>
void forward(const AttentionArgs& a, int64_t chunk_pairs, Exec& exec) {
  const Dims x(a);
  const std::vector<QueryBlock> blocks = query_blocks(a);
  for_chunks(a, chunk_pairs, blocks, false, exec, [&](const Chunk& c) {
    exec.softmax_rows(c);
    for (int64_t g = 0; g < x.group; ++g)
      for (const QueryBlock& qb : blocks)  // o = p v
        exec.product({c.count, qb.rows, x.d, qb.keys, block_scores(x, Buf::s, g, qb, false),
                      block_keys(x, Buf::v, qb, false), block_rows(x, Buf::o, g, qb, x.d, false),
                      false});
    exec.scatter_out(c);
  });
}

/** The backward from the forward's out and lse and the output gradient:
 * Exec provides, beside the forward's, gather(chunk, Buf::o) (the output
 * gradient per slot) and grad_rows(chunk) (s: raw q.k in where written,
 * probabilities from the saved lse out for every key; ds: dp in where
 * written, row_score_grad out, 0 where p is: one pass that sees the raw
 * score soft-capping's slope needs) and scatter_grads(chunk) (dq, dk, dv
 * into the gradients). The caller has computed delta (each query's dO.O).
 * dk and dv sum over the blocks and the group's heads in order, the first
 * product (the last block, which sees every key) writing all their rows. */
template <class Exec>
void backward(const AttentionArgs& a, int64_t chunk_pairs, Exec& exec) {
  const Dims x(a);
  const std::vector<QueryBlock> blocks = query_blocks(a);
  for_chunks(a, chunk_pairs, blocks, true, exec, [&](const Chunk& c) {
    for (int64_t g = 0; g < x.group; ++g)
      for (const QueryBlock& qb : blocks)  // dp = dO v^T
        exec.product({c.count, qb.rows, qb.keys, x.d, block_rows(x, Buf::o, g, qb, x.d, false),
                      block_keys(x, Buf::v, qb, true), block_scores(x, Buf::ds, g, qb, false),
                      false});
    exec.grad_rows(c);
    for (int64_t g = 0; g < x.group; ++g)
      for (const QueryBlock& qb : blocks) {
        const bool add = g > 0 || &qb != &blocks.front();
        // dv (+)= p^T dO
        exec.product({c.count, qb.keys, x.d, qb.rows, block_scores(x, Buf::s, g, qb, true),
                      block_rows(x, Buf::o, g, qb, x.d, false), block_keys(x, Buf::dv, qb, false),
                      add});
        // dq = ds k
        exec.product({c.count, qb.rows, x.d, qb.keys, block_scores(x, Buf::ds, g, qb, false),
                      block_keys(x, Buf::k, qb, false), block_rows(x, Buf::dq, g, qb, x.d, false),
                      false});
        // dk (+)= ds^T q
        exec.product({c.count, qb.keys, x.d, qb.rows, block_scores(x, Buf::ds, g, qb, true),
                      block_rows(x, Buf::q, g, qb, x.d, false), block_keys(x, Buf::dk, qb, false),
                      add});
      }
    exec.scatter_grads(c);
  });
}

/** Which attention a device with both runs: `products` (this plan) or
 * `reference` (CUDA's warp-per-row kernels, llm/cuda/attention.cu). */
enum class Path : uint8_t { products, reference };

/** The path QUANTA_CUDA_ATTENTION names (unset or empty: products). */
inline Path path_from(const char* env_value) {
  const std::string v = env_value ? env_value : "";
  if (v.empty() || v == "products") return Path::products;
  if (v == "reference") return Path::reference;
  throw std::invalid_argument("QUANTA_CUDA_ATTENTION must be products or reference, got '" + v +
                              "'");
}

/** Scratch a chunk may hold, in bytes: the scores of a few hundred heads at
 * 512 tokens, a small part of a data-centre GPU. */
inline constexpr int64_t kScratchBudgetBytes = int64_t{1} << 30;

/** Whether the plan takes these sizes on a device with `path` asked: every
 * length nonzero (the reference kernels handle the empty cases) and one
 * pair's scratch within the budget (longer sequences take the reference
 * kernels, whose memory is linear in the lengths). */
inline bool takes(const AttentionArgs& a, Path path, bool backward, int64_t acc_bytes) {
  if (path != Path::products) return false;
  if (a.batch <= 0 || a.heads <= 0 || a.kv_heads <= 0 || a.q_len <= 0 || a.kv_len <= 0 ||
      a.head_dim <= 0)
    return false;
  return Dims(a).scratch_per_pair(backward) * acc_bytes <= kScratchBudgetBytes;
}

/** Where slot s of chunk c lives: image b, query head h, and its kv head. */
struct Slot {
  int64_t b, h, hk;
};
QUANTA_HD inline Slot slot_of(const AttentionArgs& a, const Chunk& c, int64_t s) {
  const int64_t group = a.heads / a.kv_heads;
  const int64_t pair = c.first + s / group;
  const int64_t b = pair / a.kv_heads, hk = pair % a.kv_heads;
  return {b, hk * group + s % group, hk};
}

}  // namespace quanta::llm::attention_plan
