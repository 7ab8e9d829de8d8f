#pragma once
// bf16 products on the CPU: bf16 operands, f32 accumulation and an f32
// result, through oneDNN's matmul, whose JIT uses the CPU's bf16 dot-product
// instructions (AVX512_BF16, AMX) at about twice its f32 rate. Where the
// build has no oneDNN or the CPU lacks those instructions, bf16 products are
// not native and callers widen to f32 instead.
#include <cstdint>

#include "engine/cpu/gemm.h"
#include "engine/dtype.h"

namespace quanta::cpu {

/** True when bf16 products run natively: the build found oneDNN, it runs on
 * OpenMP, and the CPU has bf16 dot-product instructions. The environment
 * variable QUANTA_CPU_BF16_GEMM=0 turns it off (products widen to f32 as
 * without it); =1 turns it on wherever oneDNN is present, the CPU's
 * instructions or not (oneDNN then emulates them: for tests on any machine).
 * Read once. */
bool bf16_gemm_native();

/** c[m, n] = a[m, k] b[k, n] (or c += a b when `accumulate`), a and b bf16,
 * c f32 row-major with row stride ldc: each product of two bf16 is exact in
 * f32, sums are f32. Operands must satisfy gemm_maps. Threaded by oneDNN
 * unless called inside a parallel region. Throws when oneDNN is absent. */
void gemm_bf16(int64_t m, int64_t n, int64_t k, MatRef<bf16> a, MatRef<bf16> b, float* c,
               int64_t ldc, bool accumulate = false);

/** dst[i] = bf16(src[i]) rounded to nearest even, i < n, on the calling
 * thread (vector instructions where the CPU has them). */
void round_to_bf16(const float* src, int64_t n, bf16* dst);

/** The rows x cols operand `a` (one gemm_maps accepts) rounded to bf16 into
 * dst (rows * cols elements), packed in its own orientation: a row-major
 * operand stays row-major, a column-major one column-major. In parallel
 * unless called inside a parallel region. Returns the packed operand. */
MatRef<bf16> round_operand_to_bf16(int64_t rows, int64_t cols, MatRef<float> a, bf16* dst);

}  // namespace quanta::cpu
