#pragma once
// bf16 products on the CPU: bf16 operands, f32 accumulation and an f32
// result, through oneDNN's matmul, whose JIT uses the CPU's bf16 dot-product
// instructions (AVX512_BF16, AMX). Where the build has no oneDNN, or those
// instructions are no faster than the CPU's f32 FMAs, bf16 products are not
// native and callers widen bf16 values to f32 instead (exact: the products
// and the f32 sums are the same, in another order).
#include <cstdint>
#include <string>

#include "engine/cpu/gemm.h"
#include "engine/dtype.h"

namespace quanta::cpu {

/** True when bf16 products run natively and pay: the build found oneDNN, it
 * runs on OpenMP, and the CPU's bf16 products beat its f32 ones (AMX, or
 * AVX512_BF16 on AMD; not Intel's AVX512_BF16 without AMX, which runs them at
 * about half the f32 rate). `quanta bench engine`'s matmul_bf16 row times
 * both on the machine at hand. The environment variable
 * QUANTA_CPU_BF16_GEMM=0 turns it off (products widen to f32 as without
 * it); =1 turns it on wherever oneDNN is present, the CPU's instructions or
 * not (oneDNN then emulates them: for tests on any machine). Read once. */
bool bf16_gemm_native();

/** True when the build has oneDNN, so gemm_bf16 runs (natively or not). */
bool bf16_products_built();

/** What bf16_gemm_native() said and why, for a benchmark's header: "on: AMX",
 * "off: AVX512_BF16 without AMX on a CPU not AMD's (...)", ... */
std::string bf16_gemm_reason();

/** A CPU as the bf16 rule reads it. */
struct CpuBf16Kind {
  bool bf16_dot = false;  // AVX512_BF16 (oneDNN's avx512_core_bf16 or above)
  bool amx = false;       // AMX tiles usable (oneDNN's avx512_core_amx)
  bool amd = false;       // the vendor is AMD
};

/** Whether bf16 products beat f32 ones on a CPU of this kind: AMX, or
 * AVX512_BF16 on AMD (not Intel's AVX512_BF16 without AMX). */
bool bf16_products_pay(const CpuBf16Kind& cpu);

/** This CPU's kind (oneDNN's reading of its ISA; none without oneDNN). */
CpuBf16Kind this_cpu_bf16_kind();

/** c[m, n] = a[m, k] b[k, n] (or c += a b when `accumulate`), a and b bf16,
 * c f32 row-major with row stride ldc: each product of two bf16 is exact in
 * f32, sums are f32. Operands must satisfy gemm_maps. Threaded by oneDNN
 * unless called inside a parallel region. Throws when oneDNN is absent. */
void gemm_bf16(int64_t m, int64_t n, int64_t k, MatRef<bf16> a, MatRef<bf16> b, float* c,
               int64_t ldc, bool accumulate = false);

/** dst[i] = bf16(src[i]) rounded to nearest even, i < n, on the calling
 * thread (vector instructions where the CPU has them). */
void round_to_bf16(const float* src, int64_t n, bf16* dst);

/** dst[i] = float(bf16(src[i])): round_to_bf16's values kept in f32, for an
 * f32 product of bf16 operands where f32 products are the faster ones
 * (exactly the bf16 product's multiply-adds). dst may be src. */
void round_to_bf16_values(const float* src, int64_t n, float* dst);

/** The rows x cols operand `a` (one gemm_maps accepts) rounded to bf16 into
 * dst (rows * cols elements), packed in its own orientation: a row-major
 * operand stays row-major, a column-major one column-major. In parallel
 * unless called inside a parallel region. Returns the packed operand. */
MatRef<bf16> round_operand_to_bf16(int64_t rows, int64_t cols, MatRef<float> a, bf16* dst);

}  // namespace quanta::cpu
