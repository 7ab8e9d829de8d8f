// The whole-matrix attention plan (llm/kernels/attention_plan.h) run by an
// executor of plain loops on the host: its chunking, grouped-query expansion
// and strides must give the CPU kernels' outputs, log-sum-exps and
// gradients. The CUDA executor is the same plan with cuBLAS and three thin
// kernels, so these cases check everything of it but the device code.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "llm/kernels/attention_plan.h"
#include "llm/kernels/table.h"

using namespace quanta;
using namespace quanta::llm;
namespace plan = quanta::llm::attention_plan;

namespace {

// The plan's executor in f64 on the host: buffers per chunk, every product
// a triple loop.
struct LoopExec {
  const AttentionArgs& a;
  const double* d_out = nullptr;  // backward: [batch, q_len, heads, head_dim]
  const double* delta = nullptr;  // backward: [batch, heads, q_len]
  double *gq = nullptr, *gk = nullptr, *gv = nullptr;
  std::map<plan::Buf, std::vector<double>> bufs;
  plan::Dims x{a};
  int chunks = 0;

  explicit LoopExec(const AttentionArgs& args) : a(args) {}

  double* at(plan::Buf b) { return bufs[b].data(); }
  void begin_chunk(const plan::Chunk& c) {
    ++chunks;
    for (plan::Buf b : {plan::Buf::q, plan::Buf::k, plan::Buf::v, plan::Buf::o, plan::Buf::s,
                        plan::Buf::ds, plan::Buf::dq, plan::Buf::dk, plan::Buf::dv})
      // NaN: a step that reads what no step wrote shows in the results.
      bufs[b].assign(static_cast<size_t>(c.count * x.per_pair(b)),
                     std::numeric_limits<double>::quiet_NaN());
  }
  void gather(const plan::Chunk& c, plan::Buf which) {
    const bool query_side = which == plan::Buf::q || which == plan::Buf::o;
    const int64_t n = query_side ? c.count * x.group : c.count, t = query_side ? x.tq : x.tk;
    const int64_t H = a.heads, D = x.d;
    for (int64_t s = 0; s < n; ++s) {
      const plan::Slot sl = plan::slot_of(a, c, query_side ? s : s * x.group);
      const HeadsOperand src = which == plan::Buf::q   ? a.q
                               : which == plan::Buf::k ? a.k
                               : which == plan::Buf::v
                                   ? a.v
                                   : HeadsOperand{d_out, x.tq * H * D, H * D, D};
      const int64_t head = query_side ? sl.h : sl.hk;
      for (int64_t i = 0; i < t; ++i)
        for (int64_t d = 0; d < D; ++d)
          at(which)[(s * t + i) * D + d] =
              static_cast<const double*>(src.data)[sl.b * src.sb + i * src.st + head * src.sh + d];
    }
  }
  void product(const plan::Product& p) {
    for (int64_t i = 0; i < p.batch; ++i)
      for (int64_t r = 0; r < p.m; ++r)
        for (int64_t col = 0; col < p.n; ++col) {
          double sum = 0;
          for (int64_t k = 0; k < p.k; ++k)
            sum += at(p.a.buf)[p.a.offset + i * p.a.stride + r * p.a.rs + k * p.a.cs] *
                   at(p.b.buf)[p.b.offset + i * p.b.stride + k * p.b.rs + col * p.b.cs];
          double& c = at(p.c.buf)[p.c.offset + i * p.c.stride + r * p.c.rs + col * p.c.cs];
          c = p.accumulate ? c + sum : sum;
        }
  }
  // Row (s, i) of the chunk's scores and its lse index.
  template <class F>
  void rows(const plan::Chunk& c, F&& f) {
    for (int64_t s = 0; s < c.count * x.group; ++s) {
      const plan::Slot sl = plan::slot_of(a, c, s);
      for (int64_t i = 0; i < x.tq; ++i)
        f(sl, i, (s * x.tq + i) * x.tk, (sl.b * a.heads + sl.h) * x.tq + i);
    }
  }
  void softmax_rows(const plan::Chunk& c) {
    rows(c, [&](const plan::Slot& sl, int64_t i, int64_t row, int64_t r) {
      double* s = at(plan::Buf::s) + row;
      double m = -INFINITY, l = 0;
      for (int64_t j = 0; j < x.tk; ++j) {
        s[j] = plan::row_score<double>(a, s[j], sl.b, sl.h, i, j);
        m = std::max(m, s[j]);
      }
      for (int64_t j = 0; j < x.tk; ++j) l += plan::row_term(s[j], m);
      const double lse = plan::row_lse(m, l);
      static_cast<double*>(a.lse)[r] = lse;
      for (int64_t j = 0; j < x.tk; ++j) s[j] = plan::row_prob(s[j], lse);
    });
  }
  void grad_rows(const plan::Chunk& c) {
    rows(c, [&](const plan::Slot& sl, int64_t i, int64_t row, int64_t r) {
      double* s = at(plan::Buf::s) + row;
      double* ds = at(plan::Buf::ds) + row;
      const double lse = static_cast<const double*>(a.lse)[r];
      for (int64_t j = 0; j < x.tk; ++j) {
        double slope;
        s[j] = plan::row_prob(plan::row_score<double>(a, s[j], sl.b, sl.h, i, j, &slope), lse);
        ds[j] = plan::row_score_grad(a, s[j], ds[j], delta[r], slope);
      }
    });
  }
  // Query-side slot rows to a [batch, t, heads, d] tensor, key-side pair rows
  // to [batch, t, kv_heads, d].
  void scatter(const plan::Chunk& c, plan::Buf which, double* dst) {
    const bool query_side = which == plan::Buf::o || which == plan::Buf::dq;
    const int64_t n = query_side ? c.count * x.group : c.count, t = query_side ? x.tq : x.tk;
    const int64_t heads = query_side ? a.heads : a.kv_heads, D = x.d;
    for (int64_t s = 0; s < n; ++s) {
      const plan::Slot sl = plan::slot_of(a, c, query_side ? s : s * x.group);
      const int64_t head = query_side ? sl.h : sl.hk;
      for (int64_t i = 0; i < t; ++i)
        for (int64_t d = 0; d < D; ++d)
          dst[((sl.b * t + i) * heads + head) * D + d] = at(which)[(s * t + i) * D + d];
    }
  }
  void scatter_out(const plan::Chunk& c) { scatter(c, plan::Buf::o, static_cast<double*>(a.out)); }
  void scatter_grads(const plan::Chunk& c) {
    scatter(c, plan::Buf::dq, gq);
    scatter(c, plan::Buf::dk, gk);
    scatter(c, plan::Buf::dv, gv);
  }
};

struct Case {
  std::string name;
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim;
  bool causal, mask;
  double softcap = 0;  // Gemma 2's cap on the scores (0: none)
  int64_t window = 0;  // a sliding window (0: none)
};

// Attention's sizes, nothing else set.
AttentionArgs sizes(int64_t batch, int64_t heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,
                    int64_t head_dim) {
  AttentionArgs a;
  a.batch = batch;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.head_dim = head_dim;
  return a;
}

std::vector<double> randoms(int64_t n, std::mt19937& rng) {
  std::normal_distribution<double> nd;
  std::vector<double> v(static_cast<size_t>(n));
  for (double& e : v) e = nd(rng);
  return v;
}

double max_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(x[i]) && x[i] == y[i]) continue;
    m = std::max(m, std::fabs(x[i] - y[i]));
  }
  return m;
}

}  // namespace

TEST_CASE("attention plan: whole-matrix products over chunks equal the CPU kernels") {
  const std::vector<Case> cases = {
      {"plain", 2, 3, 3, 5, 5, 4, false, false},
      {"causal", 2, 2, 2, 7, 7, 3, true, false},
      {"grouped-query causal", 2, 4, 2, 6, 6, 4, true, false},
      {"kv cache: 3 queries over 8 keys", 1, 4, 1, 3, 8, 5, true, false},
      {"mask hiding whole rows", 2, 2, 1, 4, 6, 3, false, true},
      // Causal query blocks of 128 rows, each taking only the keys it sees.
      {"causal over three query blocks", 1, 2, 1, 300, 300, 2, true, false},
      {"kv cache over two query blocks", 1, 2, 2, 130, 200, 3, true, true},
      {"more queries than keys: early rows see none", 1, 2, 1, 140, 20, 2, true, false},
      {"whole query blocks that see no key", 1, 1, 1, 300, 20, 2, true, false},
      // A cap well inside the scores' spread, so tanh bends most of them.
      {"soft-capped grouped-query causal", 2, 4, 2, 6, 6, 4, true, false, 0.7},
      {"soft-capped under a mask, kv cache over two query blocks", 1, 2, 2, 130, 200, 3, true, true,
       1.5},
      // Sliding windows: every block but the last starts at its first
      // row's window, over 128-row blocks, a KV cache, a mask and a cap.
      {"a window of 50 over three query blocks", 1, 2, 1, 300, 300, 2, true, false, 0, 50},
      {"a window of 1 over three query blocks", 1, 2, 1, 300, 300, 2, true, false, 0, 1},
      {"a window longer than the blocks", 2, 4, 2, 300, 300, 3, true, false, 0, 200},
      {"a window, a kv cache and a mask over two query blocks", 1, 2, 2, 130, 200, 3, true, true, 0,
       70},
      {"a soft-capped window, more queries than keys", 1, 2, 1, 300, 260, 2, true, false, 0.9, 40},
  };
  for (const Case& cs : cases) {
    const std::string name = cs.name;
    CAPTURE(name);
    std::mt19937 rng(7);
    const int64_t B = cs.batch, H = cs.heads, Hk = cs.kv_heads, Tq = cs.q_len, Tk = cs.kv_len,
                  D = cs.head_dim;
    // q as [batch, heads, q_len, d] (a permuted layout), k and v as
    // [batch, kv_len, kv_heads, d].
    const std::vector<double> q = randoms(B * H * Tq * D, rng), k = randoms(B * Tk * Hk * D, rng),
                              v = randoms(B * Tk * Hk * D, rng), g = randoms(B * Tq * H * D, rng);
    std::vector<double> mask(static_cast<size_t>(B * Tq * Tk), 0.0);
    if (cs.mask) {
      mask = randoms(B * Tq * Tk, rng);
      for (int64_t j = 0; j < Tk; ++j)
        mask[static_cast<size_t>(1 * Tk + j)] = -INFINITY;  // row 1 of image 0
      if (B > 1)  // key 2 hidden from every query of image 1
        for (int64_t i = 0; i < Tq; ++i)
          mask[static_cast<size_t>(Tq * Tk + i * Tk + 2)] = -INFINITY;
    }
    AttentionArgs a = sizes(B, H, Hk, Tq, Tk, D);
    a.dtype = DType::f64;
    a.scale = 1.0 / std::sqrt(double(D));
    a.causal = cs.causal;
    a.softcap = cs.softcap;
    a.window = cs.window;
    a.q = {q.data(), H * Tq * D, D, Tq * D};
    a.k = {k.data(), Tk * Hk * D, Hk * D, D};
    a.v = {v.data(), Tk * Hk * D, Hk * D, D};
    if (cs.mask) a.mask = {mask.data(), Tq * Tk, 0, Tk, 1};  // [batch, 1, q_len, kv_len]

    const int64_t nq = B * Tq * H * D, nk = B * Tk * Hk * D, nl = B * H * Tq;
    std::vector<double> out_ref(nq), lse_ref(nl), gq_ref(nq), gk_ref(nk), gv_ref(nk), delta(nl);
    AttentionArgs ref = a;
    ref.out = out_ref.data();
    ref.lse = lse_ref.data();
    const LlmKernelTable& cpu = llm_kernels(Device::cpu());
    cpu.attention(ref);
    std::vector<double> scratch(nl);
    cpu.attention_grad(ref, g.data(), scratch.data(), gq_ref.data(), gk_ref.data(), gv_ref.data());
    // Each query's dO.O, which the caller of the backward plan computes.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Tq; ++i) {
          double d = 0;
          for (int64_t e = 0; e < D; ++e) {
            const int64_t at = ((b * Tq + i) * H + h) * D + e;
            d += out_ref[at] * g[at];
          }
          delta[(b * H + h) * Tq + i] = d;
        }

    const int64_t pairs = B * Hk;
    for (int64_t chunk : {int64_t{1}, int64_t{2}, pairs}) {
      CAPTURE(chunk);
      std::vector<double> out(nq), lse(nl), gq(nq), gk(nk), gv(nk);
      AttentionArgs mine = a;
      mine.out = out.data();
      mine.lse = lse.data();
      LoopExec fwd(mine);
      plan::forward(mine, chunk, fwd);
      CHECK(fwd.chunks == (pairs + chunk - 1) / chunk);
      CHECK(max_diff(out, out_ref) < 1e-12);
      CHECK(max_diff(lse, lse_ref) < 1e-12);
      for (size_t i = 0; i < lse.size(); ++i) CHECK(std::isinf(lse[i]) == std::isinf(lse_ref[i]));
      LoopExec bwd(mine);
      bwd.d_out = g.data();
      bwd.delta = delta.data();
      bwd.gq = gq.data();
      bwd.gk = gk.data();
      bwd.gv = gv.data();
      plan::backward(mine, chunk, bwd);
      CHECK(max_diff(gq, gq_ref) < 1e-12);
      CHECK(max_diff(gk, gk_ref) < 1e-12);
      CHECK(max_diff(gv, gv_ref) < 1e-12);
    }
  }
}

TEST_CASE("attention plan: a chunk's scratch stays within its budget") {
  const AttentionArgs a = sizes(4, 8, 2, 512, 512, 64);
  const plan::Dims x(a);
  // Per pair: 4 query heads' scores (two buffers backward) and the rest.
  CHECK(x.scratch_per_pair(false) == 4 * 512 * 64 * 2 + 512 * 64 * 2 + 4 * 512 * 512);
  CHECK(x.scratch_per_pair(true) ==
        x.scratch_per_pair(false) + 4 * 512 * 512 + 4 * 512 * 64 + 2 * 512 * 64);
  const int64_t per = x.scratch_per_pair(true);
  CHECK(plan::pairs_per_chunk(a, true, 3 * per + 1) == 3);
  CHECK(plan::pairs_per_chunk(a, true, per / 2) == 1);     // never 0
  CHECK(plan::pairs_per_chunk(a, true, 1000 * per) == 8);  // never more than there are
}

TEST_CASE("attention plan: which path a device takes, and the sizes the plan refuses") {
  CHECK(plan::path_from(nullptr) == plan::Path::products);
  CHECK(plan::path_from("") == plan::Path::products);
  CHECK(plan::path_from("products") == plan::Path::products);
  CHECK(plan::path_from("reference") == plan::Path::reference);
  CHECK_THROWS_WITH_AS(plan::path_from("flash"),
                       "QUANTA_CUDA_ATTENTION must be products or reference, got 'flash'",
                       std::invalid_argument);
  const AttentionArgs a = sizes(2, 4, 2, 512, 512, 64);
  CHECK(plan::takes(a, plan::Path::products, true, 4));
  CHECK_FALSE(plan::takes(a, plan::Path::reference, true, 4));
  // Empty lengths go to the reference kernels, which handle them.
  for (int64_t AttentionArgs::*len : {&AttentionArgs::batch, &AttentionArgs::q_len,
                                      &AttentionArgs::kv_len, &AttentionArgs::head_dim}) {
    AttentionArgs e = a;
    e.*len = 0;
    CHECK_FALSE(plan::takes(e, plan::Path::products, false, 4));
  }
  // One pair's scores past the budget: 2 query heads x 16384^2 x 4 bytes.
  AttentionArgs longer = a;
  longer.q_len = longer.kv_len = 16384;
  CHECK_FALSE(plan::takes(longer, plan::Path::products, false, 4));
}

TEST_CASE("attention plan: causal query blocks take only the keys they see, the last first") {
  AttentionArgs a;
  a.causal = true;
  a.q_len = a.kv_len = 300;
  std::vector<plan::QueryBlock> b = plan::query_blocks(a);
  REQUIRE(b.size() == 3);
  CHECK(b[0].first == 256);
  CHECK(b[0].rows == 44);
  CHECK(b[0].keys == 300);  // the last sees every key: dk and dv start there
  CHECK(b[1].first == 128);
  CHECK(b[1].keys == 256);
  CHECK(b[2].first == 0);
  CHECK(b[2].keys == 128);
  a.q_len = 3;  // a KV cache's last 3 of 8 positions: one block, every key
  a.kv_len = 8;
  b = plan::query_blocks(a);
  REQUIRE(b.size() == 1);
  CHECK(b[0].keys == 8);
  a.q_len = 300;  // rows 0..279 see no key: a block of only those still takes one
  a.kv_len = 20;
  b = plan::query_blocks(a);
  REQUIRE(b.size() == 3);
  CHECK(b[0].keys == 20);
  CHECK(b[1].keys == 1);
  CHECK(b[2].keys == 1);
  a.causal = false;
  b = plan::query_blocks(a);
  REQUIRE(b.size() == 1);
  CHECK(b[0].rows == 300);
  CHECK(b[0].keys == 20);
  // A sliding window of 50: the last block still takes every key from 0
  // (dk and dv start there); the others from their first row's window.
  a.causal = true;
  a.q_len = a.kv_len = 300;
  a.window = 50;
  b = plan::query_blocks(a);
  REQUIRE(b.size() == 3);
  CHECK(b[0].key_first == 0);
  CHECK(b[0].keys == 300);
  CHECK(b[1].key_first == 128 - 49);  // row 128 sees keys 79..128
  CHECK(b[1].keys == 256 - 79);
  CHECK(b[2].key_first == 0);
  CHECK(b[2].keys == 128);
}
