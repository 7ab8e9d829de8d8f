// The CPU's scaled dot-product attention, tiled as FlashAttention-2 is: a
// block of queries walks the key blocks with an online softmax (a running
// max and sum per query), so memory is one block of scores per thread, never
// a q_len x kv_len matrix. The backward recomputes each block's
// probabilities from the saved log-sum-exp. With enough (image, key head)
// pairs one task per pair walks its key blocks in order, adding dK, dV and
// its own dQ rows (five products per block, as FlashAttention-2); with
// fewer, key blocks own their dK and dV (one pass) and query blocks their dQ
// (a second). Either way no two threads add into one gradient row and every
// sum runs in a fixed order.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "engine/cpu/gemm.h"
#include "engine/cpu/parallel.h"
#include "engine/eigen.h"
#include "llm/cpu/kernels.h"
#include "llm/kernels/functors.h"

namespace quanta::llm::llm_cpu {
namespace {

// 128 x 128 blocks: each product is 2^20 multiply-adds (head_dim 64), the
// size the CPU's GEMM entry hands to oneDNN.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 128;

template <class A>
using Mat = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// A row-major block [rows, cols] with row stride rs, as the products read
// it: a block of scratch, or rows of an operand read in place.
template <class A>
struct View {
  const A* p = nullptr;
  int64_t rows = 0, cols = 0, rs = 0;
};

template <class A>
View<A> view(const Mat<A>& m) {
  return {m.data(), m.rows(), m.cols(), std::max<int64_t>(m.cols(), 1)};
}

// q, k, v and the output gradient's rows as the products read them (views
// of the operands or of the buffers beside them), and the blocks the kernels
// compute.
template <class A>
struct Scratch {
  Mat<A> q, k, v, d_out;  // widened rows where an operand is not in A
  View<A> Q, K, V, DO;
  Mat<A> o, s, dp, dq, dk, dv;
  Mat<A> slope;  // soft-capping's d capped / d score, for the backward
  std::vector<A> m, l;
};

// How a block matrix enters a product: as it is, or transposed.
enum class Op { plain, transposed };

template <class A>
cpu::MatRef<A> operand(const View<A>& x, Op op) {
  return op == Op::plain ? cpu::MatRef<A>{x.p, x.rs, 1} : cpu::MatRef<A>{x.p, 1, x.rs};
}

// c[m, n] (row stride ldc) = or += op(a) op(b), on this thread, through the
// CPU's one GEMM entry: full 128-wide blocks are products of 2^20
// multiply-adds, which it hands to oneDNN's JIT kernels (about 1.4x Eigen's
// on these shapes); bf16 products under MixedPrecision.
template <class A>
void product(const AttentionArgs& a, const View<A>& x, Op ox, const View<A>& y, Op oy, A* c,
             int64_t ldc, bool accumulate) {
  const int64_t m = ox == Op::plain ? x.rows : x.cols;
  const int64_t k = ox == Op::plain ? x.cols : x.rows;
  const int64_t n = oy == Op::plain ? y.cols : y.rows;
  cpu::gemm<A>(m, n, k, operand(x, ox), operand(y, oy), c, ldc, accumulate, a.bf16_products);
}

// c = op(a) op(b), c resized, or c += op(a) op(b).
template <class A>
void product(const AttentionArgs& a, const View<A>& x, Op ox, const View<A>& y, Op oy, Mat<A>& c,
             bool accumulate) {
  if (!accumulate) c.resize(ox == Op::plain ? x.rows : x.cols, oy == Op::plain ? y.cols : y.rows);
  product(a, x, ox, y, oy, c.data(), c.cols(), accumulate);
}

// Rows t0 .. t0 + n of head h of image b as the products read them: in
// place where the operand is already in A (f32, f64) and its rows lie at
// least a row apart, else widened into `buf` (a pass the products of a
// 500M QLoRA step's attention spent 7% of their time on).
template <class T, class A>
View<A> load_rows(const HeadsOperand& op, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t D,
                  Mat<A>& buf) {
  const T* base = static_cast<const T*>(op.data) + b * op.sb + h * op.sh;
  if constexpr (std::is_same_v<T, A>) {
    if (n <= 1 || op.st >= D)
      return {base + t0 * op.st, n, D, n <= 1 ? std::max<int64_t>(D, 1) : op.st};
  }
  buf.resize(n, D);
  for (int64_t t = 0; t < n; ++t) {
    const T* row = base + (t0 + t) * op.st;
    for (int64_t d = 0; d < D; ++d) buf(t, d) = static_cast<A>(row[d]);
  }
  return view(buf);
}

template <class T, class A>
void store_rows(const Mat<A>& m, T* data, int64_t sb, int64_t st, int64_t sh, int64_t b, int64_t h,
                int64_t t0) {
  for (int64_t t = 0; t < m.rows(); ++t) {
    T* row = data + b * sb + (t0 + t) * st + h * sh;
    for (int64_t d = 0; d < m.cols(); ++d) row[d] = static_cast<T>(m(t, d));
  }
}

// scores = scale q k^T (soft-capped when a.softcap is set: cap tanh(x /
// cap), and with `slopes` 1 - tanh^2 kept in s.slope) + mask, -inf where the
// causal mask hides a key.
template <class A>
void scores(const AttentionArgs& a, int64_t b, int64_t h, int64_t i0, int64_t j0, Scratch<A>& s,
            bool slopes = false) {
  product(a, s.Q, Op::plain, s.K, Op::transposed, s.s, false);
  s.s *= static_cast<A>(a.scale);
  if (a.softcap > 0) {
    const A cap = static_cast<A>(a.softcap);
    s.s = (s.s.array() / cap).tanh().matrix();
    if (slopes) s.slope = (A(1) - s.s.array().square()).matrix();
    s.s *= cap;
  }
  const MaskOperand& mk = a.mask;
  for (int64_t i = 0; i < s.s.rows(); ++i) {
    if (mk.data) {
      const A* row = static_cast<const A*>(mk.data) + b * mk.sb + h * mk.sh + (i0 + i) * mk.si;
      for (int64_t j = 0; j < s.s.cols(); ++j) s.s(i, j) += row[(j0 + j) * mk.sj];
    }
    if (a.causal) {
      const int64_t last = fn::last_visible_key(i0 + i, a.q_len, a.kv_len);
      for (int64_t j = std::max<int64_t>(0, last + 1 - j0); j < s.s.cols(); ++j)
        s.s(i, j) = -INFINITY;
      // Keys before a sliding window.
      const int64_t first = fn::first_visible_key(i0 + i, a.q_len, a.kv_len, a.window);
      for (int64_t j = 0; j < std::min<int64_t>(first - j0, s.s.cols()); ++j) s.s(i, j) = -INFINITY;
    }
  }
}

// The keys a block of queries i0 .. i0 + ni may see: [0, end).
int64_t keys_seen(const AttentionArgs& a, int64_t i0, int64_t ni) {
  if (!a.causal) return a.kv_len;
  const int64_t last = fn::last_visible_key(i0 + ni - 1, a.q_len, a.kv_len);
  return std::clamp<int64_t>(last + 1, 0, a.kv_len);
}

// The first key block a block of queries from i0 may see: a sliding window
// leaves out the blocks wholly before its first query's window.
int64_t first_key_block(const AttentionArgs& a, int64_t i0) {
  if (!a.causal) return 0;
  return fn::first_visible_key(i0, a.q_len, a.kv_len, a.window) / kBlockK * kBlockK;
}

int64_t group_of(const AttentionArgs& a) { return a.heads / a.kv_heads; }

template <class T, class A>
void forward_block(const AttentionArgs& a, int64_t b, int64_t h, int64_t i0, Scratch<A>& s) {
  const int64_t D = a.head_dim, ni = std::min(kBlockQ, a.q_len - i0), hk = h / group_of(a);
  s.Q = load_rows<T, A>(a.q, b, h, i0, ni, D, s.q);
  s.o.setZero(ni, D);
  s.m.assign(ni, -INFINITY);
  s.l.assign(ni, A(0));
  const int64_t end = keys_seen(a, i0, ni);
  for (int64_t j0 = first_key_block(a, i0); j0 < end; j0 += kBlockK) {
    const int64_t nj = std::min(kBlockK, end - j0);
    s.K = load_rows<T, A>(a.k, b, hk, j0, nj, D, s.k);
    s.V = load_rows<T, A>(a.v, b, hk, j0, nj, D, s.v);
    scores(a, b, h, i0, j0, s);
    for (int64_t i = 0; i < ni; ++i) {
      const A m_new = std::max(s.m[i], s.s.row(i).maxCoeff());
      if (m_new == -INFINITY) {  // nothing seen yet: this block adds nothing
        s.s.row(i).setZero();
        continue;
      }
      const A alpha = std::exp(s.m[i] - m_new);
      s.s.row(i) = (s.s.row(i).array() - m_new).exp().matrix();
      s.l[i] = s.l[i] * alpha + s.s.row(i).sum();
      s.o.row(i) *= alpha;
      s.m[i] = m_new;
    }
    product(a, view(s.s), Op::plain, s.V, Op::plain, s.o, true);
  }
  A* lse = static_cast<A*>(a.lse) + (b * a.heads + h) * a.q_len + i0;
  for (int64_t i = 0; i < ni; ++i) {
    if (s.l[i] > A(0)) {
      s.o.row(i) /= s.l[i];
      lse[i] = s.m[i] + std::log(s.l[i]);
    } else {
      s.o.row(i).setZero();
      lse[i] = -INFINITY;
    }
  }
  const int64_t H = a.heads;
  store_rows<T, A>(s.o, static_cast<T*>(a.out), a.q_len * H * D, H * D, D, b, h, i0);
}

// p = exp(s - lse) and ds = p (dO v^T - delta) for the block in s.s, s.dp,
// a row at a time with Eigen's vectorised exp (fn::attention_prob and
// fn::attention_score_grad per element, as the CUDA kernels compute them);
// soft-capped, ds is then taken through the cap (times s.slope).
template <class A>
void probs_and_score_grads(const AttentionArgs& a, const A* delta, int64_t b, int64_t h, int64_t i0,
                           Scratch<A>& s) {
  const A* lse = static_cast<const A*>(a.lse) + (b * a.heads + h) * a.q_len + i0;
  const A* dl = delta + (b * a.heads + h) * a.q_len + i0;
  product(a, s.DO, Op::plain, s.V, Op::transposed, s.dp, false);
  for (int64_t i = 0; i < s.s.rows(); ++i) {
    if (lse[i] == -INFINITY) {  // a query that sees no key: p = 0
      s.s.row(i).setZero();
      s.dp.row(i).setZero();
      continue;
    }
    s.s.row(i) = (s.s.row(i).array() - lse[i]).exp().matrix();
    s.dp.row(i) = (s.s.row(i).array() * (s.dp.row(i).array() - dl[i])).matrix();
    if (a.softcap > 0) s.dp.row(i) = (s.dp.row(i).array() * s.slope.row(i).array()).matrix();
  }
}

// dK and dV of one key block (and, when dq is given, its share of dQ added
// into dq: the group's query rows [(h - hk G) q_len + i, D], unscaled).
template <class T, class A>
void key_block_grads(const AttentionArgs& a, const HeadsOperand& d_out, const A* delta, int64_t b,
                     int64_t hk, int64_t j0, T* gk, T* gv, Scratch<A>& s, Mat<A>* dq = nullptr) {
  const int64_t D = a.head_dim, nj = std::min(kBlockK, a.kv_len - j0), G = group_of(a);
  s.K = load_rows<T, A>(a.k, b, hk, j0, nj, D, s.k);
  s.V = load_rows<T, A>(a.v, b, hk, j0, nj, D, s.v);
  s.dk.setZero(nj, D);
  s.dv.setZero(nj, D);
  const int64_t begin = a.causal ? fn::first_seeing_query(j0, a.q_len, a.kv_len) : 0;
  // Past the block's last key's window no query sees it.
  const int64_t end =
      a.causal ? fn::last_seeing_query(j0 + nj - 1, a.q_len, a.kv_len, a.window) + 1 : a.q_len;
  for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
    for (int64_t i0 = begin; i0 < end; i0 += kBlockQ) {
      const int64_t ni = std::min(kBlockQ, end - i0);
      s.Q = load_rows<T, A>(a.q, b, h, i0, ni, D, s.q);
      s.DO = load_rows<T, A>(d_out, b, h, i0, ni, D, s.d_out);
      scores(a, b, h, i0, j0, s, true);
      probs_and_score_grads(a, delta, b, h, i0, s);
      product(a, view(s.s), Op::transposed, s.DO, Op::plain, s.dv, true);
      product(a, view(s.dp), Op::transposed, s.Q, Op::plain, s.dk, true);
      if (dq)
        product(a, view(s.dp), Op::plain, s.K, Op::plain,
                dq->data() + ((h - hk * G) * a.q_len + i0) * D, D, true);
    }
  s.dk *= static_cast<A>(a.scale);
  const int64_t Hk = a.kv_heads;
  store_rows<T, A>(s.dk, gk, a.kv_len * Hk * D, Hk * D, D, b, hk, j0);
  store_rows<T, A>(s.dv, gv, a.kv_len * Hk * D, Hk * D, D, b, hk, j0);
}

template <class T, class A>
void query_block_grads(const AttentionArgs& a, const HeadsOperand& d_out, const A* delta, int64_t b,
                       int64_t h, int64_t i0, T* gq, Scratch<A>& s) {
  const int64_t D = a.head_dim, ni = std::min(kBlockQ, a.q_len - i0), hk = h / group_of(a);
  s.Q = load_rows<T, A>(a.q, b, h, i0, ni, D, s.q);
  s.DO = load_rows<T, A>(d_out, b, h, i0, ni, D, s.d_out);
  s.dq.setZero(ni, D);
  const int64_t end = keys_seen(a, i0, ni);
  for (int64_t j0 = first_key_block(a, i0); j0 < end; j0 += kBlockK) {
    const int64_t nj = std::min(kBlockK, end - j0);
    s.K = load_rows<T, A>(a.k, b, hk, j0, nj, D, s.k);
    s.V = load_rows<T, A>(a.v, b, hk, j0, nj, D, s.v);
    scores(a, b, h, i0, j0, s, true);
    probs_and_score_grads(a, delta, b, h, i0, s);
    product(a, view(s.dp), Op::plain, s.K, Op::plain, s.dq, true);
  }
  s.dq *= static_cast<A>(a.scale);
  const int64_t H = a.heads;
  store_rows<T, A>(s.dq, gq, a.q_len * H * D, H * D, D, b, h, i0);
}

// All gradients of one (image, key head) in one pass, FlashAttention-2's
// five products per block: key blocks in order, each adding its share of dQ
// for the group's query heads into an accumulator that only this task
// touches, so the sums still have one order.
template <class T, class A>
void group_grads(const AttentionArgs& a, const HeadsOperand& d_out, const A* delta, int64_t b,
                 int64_t hk, T* gq, T* gk, T* gv, Scratch<A>& s) {
  const int64_t G = group_of(a), D = a.head_dim, H = a.heads;
  Mat<A> dq = Mat<A>::Zero(G * a.q_len, D);
  for (int64_t j0 = 0; j0 < a.kv_len; j0 += kBlockK)
    key_block_grads<T, A>(a, d_out, delta, b, hk, j0, gk, gv, s, &dq);
  dq *= static_cast<A>(a.scale);
  for (int64_t g = 0; g < G; ++g) {
    const Mat<A> rows = dq.middleRows(g * a.q_len, a.q_len);
    store_rows<T, A>(rows, gq, a.q_len * H * D, H * D, D, b, hk * G + g, 0);
  }
}

int64_t blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// At least this many (image, key head) pairs make the one-pass backward
// parallel enough; fewer take two passes (key blocks, then query blocks),
// recomputing the scores once more. Chosen by shape alone, never by the
// thread count, so the bits never depend on the machine.
constexpr int64_t kOnePassGroups = 8;

// Calls f(task, scratch) for task in [0, n), one scratch per thread's chunk.
template <class A, class F>
void for_tasks(int64_t n, F&& f) {
  cpu::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    Scratch<A> s;
    for (int64_t t = lo; t < hi; ++t) f(t, s);
  });
}

}  // namespace

void attention(const AttentionArgs& a) {
  dispatch_llm(a.dtype, "scaled_dot_product_attention", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    if (a.batch * a.heads * a.q_len == 0) return;
    const int64_t nqb = blocks(a.q_len, kBlockQ);
    for_tasks<A>(a.batch * a.heads * nqb, [&](int64_t t, Scratch<A>& s) {
      const int64_t qb = t % nqb, bh = t / nqb;
      forward_block<T, A>(a, bh / a.heads, bh % a.heads, qb * kBlockQ, s);
    });
  });
}

void attention_grad(const AttentionArgs& a, const void* grad_out, void* delta_, void* gq, void* gk,
                    void* gv) {
  dispatch_llm(a.dtype, "scaled_dot_product_attention backward", [&](auto types) {
    using T = typename decltype(types)::data;
    using A = typename decltype(types)::acc;
    const int64_t B = a.batch, H = a.heads, Hk = a.kv_heads, D = a.head_dim;
    const int64_t Tq = a.q_len, S = a.kv_len;
    A* delta = static_cast<A*>(delta_);
    const T* dO = static_cast<const T*>(grad_out);
    const T* O = static_cast<const T*>(a.out);
    // delta[b, h, i] = dO . O of the query's row.
    cpu::parallel_for(0, B * Tq * H,
                      std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(D, 1)),
                      [&](int64_t lo, int64_t hi) {
                        for (int64_t r = lo; r < hi; ++r) {
                          A acc = 0;
                          for (int64_t d = 0; d < D; ++d)
                            acc += static_cast<A>(dO[r * D + d]) * static_cast<A>(O[r * D + d]);
                          const int64_t h = r % H, i = (r / H) % Tq, b = r / (H * Tq);
                          delta[(b * H + h) * Tq + i] = acc;
                        }
                      });
    const HeadsOperand d_out{grad_out, Tq * H * D, H * D, D};
    if (B * Hk >= kOnePassGroups) {
      for_tasks<A>(B * Hk, [&](int64_t t, Scratch<A>& s) {
        group_grads<T, A>(a, d_out, delta, t / Hk, t % Hk, static_cast<T*>(gq), static_cast<T*>(gk),
                          static_cast<T*>(gv), s);
      });
      return;
    }
    const int64_t nkb = blocks(S, kBlockK);
    for_tasks<A>(B * Hk * nkb, [&](int64_t t, Scratch<A>& s) {
      const int64_t kb = t % nkb, bh = t / nkb;
      key_block_grads<T, A>(a, d_out, delta, bh / Hk, bh % Hk, kb * kBlockK, static_cast<T*>(gk),
                            static_cast<T*>(gv), s);
    });
    const int64_t nqb = blocks(Tq, kBlockQ);
    for_tasks<A>(B * H * nqb, [&](int64_t t, Scratch<A>& s) {
      const int64_t qb = t % nqb, bh = t / nqb;
      query_block_grads<T, A>(a, d_out, delta, bh / H, bh % H, qb * kBlockQ, static_cast<T*>(gq),
                              s);
    });
  });
}

}  // namespace quanta::llm::llm_cpu
