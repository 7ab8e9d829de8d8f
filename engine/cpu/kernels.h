#pragma once
// The CPU table's entries, one family per file (elementwise_kernels.cpp,
// reduce_kernels.cpp, gemm.cpp); kernel_table.cpp puts them in the table.
#include "engine/kernels/table.h"

namespace quanta::cpu {

void fill(const Shape& shape, const Operand& dst, double value);
void copy(const Shape& shape, const Operand& dst, const Operand& src);
void unary(UnaryOp op, const ScalarArgs& args, const Shape& shape, const Operand& out,
           const Operand& in);
void binary(BinaryOp op, const Shape& shape, const Operand& out, const Operand& a,
            const Operand& b);
void update(UpdateOp op, const ScalarArgs& args, const Shape& shape, const Operand& dst,
            const Operand& a, const Operand& b);
void where(const Shape& shape, const Operand& out, const Operand& cond, const Operand& a,
           const Operand& b);
void reduce_rows(RowReduce op, DType in_dtype, const void* rows, int64_t outer, int64_t inner,
                 void* out);
void gemm_entry(const GemmArgs& args);

}  // namespace quanta::cpu
