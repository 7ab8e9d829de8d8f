#include "engine/cpu/gemm_bf16.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/onednn.h"
#include "engine/cpu/parallel.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace quanta::cpu {
namespace {

bool cpu_is_amd() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  // The vendor string "AuthenticAMD" in ebx, edx, ecx.
  return ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;
#else
  return false;
#endif
}

#ifdef QUANTA_GEMM_ONEDNN
// What QUANTA_CPU_BF16_GEMM asks for: -1 unset, else 0 or 1.
int bf16_gemm_override() {
  const char* v = std::getenv("QUANTA_CPU_BF16_GEMM");
  if (!v || !*v) return -1;
  return std::string(v) == "0" ? 0 : 1;
}

// A strided rows x cols operand (one gemm_maps accepts) as the strides of a
// plain oneDNN layout: row-major or column-major with the outer stride a
// BLAS-style interface accepts even where a dim of 1 makes it meaningless.
dnnl::memory::dims plain_strides(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  const GemmLayout l = gemm_layout(rows, cols, rs, cs);
  return l.row_major ? dnnl::memory::dims{l.outer, 1} : dnnl::memory::dims{1, l.outer};
}

// One matmul primitive per shape, layout and accumulation, made once per
// thread (kept_primitive).
struct ProductKey {
  int64_t m, n, k, ars, acs, brs, bcs, ldc;
  bool accumulate;
  auto tie() const { return std::tie(m, n, k, ars, acs, brs, bcs, ldc, accumulate); }
  bool operator<(const ProductKey& o) const { return tie() < o.tie(); }
};

struct Product {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c;
};

Product make_product(const ProductKey& key) {
  using dt = dnnl::memory::data_type;
  Product p;
  p.a = dnnl::memory::desc({key.m, key.k}, dt::bf16, {key.ars, key.acs});
  p.b = dnnl::memory::desc({key.k, key.n}, dt::bf16, {key.brs, key.bcs});
  p.c = dnnl::memory::desc({key.m, key.n}, dt::f32, {key.ldc, 1});
  dnnl::primitive_attr attr;
  if (key.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::desc desc(p.a, p.b, p.c);
  p.primitive = dnnl::matmul(dnnl::matmul::primitive_desc(desc, attr, onednn_engine()));
  return p;
}

// Outputs from this many elements (past the L2 cache) that are added onto
// take the product into scratch and a pass to add it: oneDNN's matmul adding
// onto its output (a sum post-op) took 7.55 against 7.17 ms at [2048, 1280]
// x [1280, 1280] and 21.4 against 20.8 at [2048, 1280] x [1280, 3456]
// (a plain product 6.9 and 19.3).
constexpr int64_t kAddAfterElements = int64_t{1} << 18;

const Product& product_for(const ProductKey& key) {
  return kept_primitive<ProductKey, Product>(key, make_product);
}
#endif

}  // namespace

// AMX tiles: several times the f32 rate. AMD's AVX512_BF16 (Zen 4 and
// later): twice the f32 rate, measured on Zen 5. Intel's AVX512_BF16 without
// AMX (Cooper Lake, or a later Xeon under a hypervisor that hides AMX):
// measured on such a VM at 120-170 GFLOP/s for the QLoRA step's shapes
// against 310-320 in f32, in our oneDNN 2.6 and in PyTorch's oneDNN 3 alike
// (docs/performance.md); there the f32 product of the same bf16 values is
// the faster one, with the same sums in another order.
bool bf16_products_pay(const CpuBf16Kind& cpu) { return cpu.amx || (cpu.bf16_dot && cpu.amd); }

CpuBf16Kind this_cpu_bf16_kind() {
  CpuBf16Kind kind;
#ifdef QUANTA_GEMM_ONEDNN
  // oneDNN's ISA levels are cumulative bit masks.
  const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const auto at_least = [isa](dnnl_cpu_isa_t level) {
    const unsigned bits = static_cast<unsigned>(level);
    return (isa & bits) == bits;
  };
  kind.bf16_dot = at_least(dnnl_cpu_isa_avx512_core_bf16);
  kind.amx = at_least(dnnl_cpu_isa_avx512_core_amx);
#endif
  kind.amd = cpu_is_amd();
  return kind;
}

namespace {

// The bf16 decision and its reason, made once: the override, the build, and
// otherwise bf16_products_pay on this CPU's kind.
struct Bf16Decision {
  bool on = false;
  std::string why;
};

Bf16Decision decide_bf16() {
#ifdef QUANTA_GEMM_ONEDNN
  if (!onednn_on_openmp()) return {false, "oneDNN does not run on OpenMP in this build"};
  if (const int asked = bf16_gemm_override(); asked != -1)
    return {asked == 1, std::string("QUANTA_CPU_BF16_GEMM=") + (asked == 1 ? "1" : "0")};
  const CpuBf16Kind cpu = this_cpu_bf16_kind();
  const bool on = bf16_products_pay(cpu);
  if (cpu.amx) return {on, "AMX"};
  if (cpu.bf16_dot && cpu.amd) return {on, "AVX512_BF16 on AMD"};
  if (cpu.bf16_dot)
    return {on, "AVX512_BF16 without AMX on a CPU not AMD's (f32 products are faster)"};
  return {on, "no bf16 dot-product instructions"};
#else
  return {false, "no oneDNN in this build"};
#endif
}

const Bf16Decision& bf16_decision() {
  static const Bf16Decision decision = decide_bf16();
  return decision;
}

}  // namespace

bool bf16_gemm_native() { return bf16_decision().on; }

std::string bf16_gemm_reason() {
  return std::string(bf16_decision().on ? "on: " : "off: ") + bf16_decision().why;
}

bool bf16_products_built() {
#ifdef QUANTA_GEMM_ONEDNN
  return true;
#else
  return false;
#endif
}

void gemm_bf16(int64_t m, int64_t n, int64_t k, MatRef<bf16> a, MatRef<bf16> b, float* c,
               int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
#ifdef QUANTA_GEMM_ONEDNN
  if (accumulate && m * n >= kAddAfterElements) {
    const ScratchBuffer sums(sizeof(float) * size_t(m * n));
    float* s = sums.as<float>();
    gemm_bf16(m, n, k, a, b, s, n, false);
    const int64_t c_strides[2] = {ldc, 1}, s_strides[2] = {n, 1};
    const Operand sum{s, DType::f32, s_strides};
    update(UpdateOp::add_scaled, ScalarArgs{1.0, 0.0}, {m, n}, {c, DType::f32, c_strides}, sum,
           sum);
    return;
  }
  const dnnl::memory::dims sa = plain_strides(m, k, a.rs, a.cs);
  const dnnl::memory::dims sb = plain_strides(k, n, b.rs, b.cs);
  const ProductKey key{m, n, k, sa[0], sa[1], sb[0], sb[1], std::max<int64_t>(ldc, n), accumulate};
  try {
    const Product& p = product_for(key);
    dnnl::stream& stream = onednn_stream();
    // oneDNN takes handles as void*; it only reads the operands.
    dnnl::memory ma(p.a, onednn_engine(), const_cast<bf16*>(a.p));
    dnnl::memory mb(p.b, onednn_engine(), const_cast<bf16*>(b.p));
    dnnl::memory mc(p.c, onednn_engine(), c);
    p.primitive.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
    stream.wait();
  } catch (const dnnl::error& e) {
    throw std::runtime_error("[gemm] oneDNN's bf16 matmul failed on " + std::to_string(m) + "x" +
                             std::to_string(n) + "x" + std::to_string(k) + ": " + e.what());
  }
#else
  (void)a, (void)b, (void)c, (void)ldc;
  throw std::logic_error("[gemm] bf16 products need oneDNN, which this build lacks");
#endif
}

MatRef<bf16> round_operand_to_bf16(int64_t rows, int64_t cols, MatRef<float> a, bf16* dst) {
  const GemmLayout l = gemm_layout(rows, cols, a.rs, a.cs);
  const int64_t lines = l.row_major ? rows : cols, len = l.row_major ? cols : rows;
  parallel_for(0, lines, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(len, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t i = lo; i < hi; ++i)
                   round_to_bf16(a.p + i * l.outer, len, dst + i * len);
               });
  return l.row_major ? MatRef<bf16>{dst, len, 1} : MatRef<bf16>{dst, 1, len};
}

namespace {

#if defined(__AVX512F__)
// bf16(v)'s bits in the low half of each 32-bit lane, computed in integer
// lanes so every element rounds as the scalar tail does: the high half of
// v's bits plus a carry from the low half, ties to even; a NaN becomes the
// quiet NaN of its sign. (The CPU's own conversion, vcvtneps2bf16, flushes
// subnormal inputs to zero, which PyTorch's rounding and CUDA's do not.)
__m512i bf16_lanes(__m512 v) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
  const __m512i quiet = _mm512_set1_epi32(0x7FC0), sign = _mm512_set1_epi32(0x8000);
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  const __m512i carry = _mm512_add_epi32(half, _mm512_and_si512(high, one));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v), carry), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_or_si512(quiet, _mm512_and_si512(high, sign)));
}
#endif

}  // namespace

void round_to_bf16(const float* src, int64_t n, bf16* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(bf16_lanes(_mm512_loadu_ps(src + i))));
#endif
  for (; i < n; ++i) dst[i] = bf16(src[i]);
}

void round_to_bf16_values(const float* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(bf16_lanes(_mm512_loadu_ps(src + i)), 16)));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(bf16(src[i]));
}

}  // namespace quanta::cpu
