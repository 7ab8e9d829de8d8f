#pragma once
// The CPU table's entries, one family per file (elementwise_kernels.cpp,
// reduce_kernels.cpp, softmax_kernels.cpp, gemm.cpp); kernel_table.cpp puts
// them in the table.
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
void stat_rows(RowStat op, double param, DType dtype, const void* rows, int64_t outer,
               int64_t inner, void* out);
void index_rows(RowReduce op, DType dtype, const void* rows, int64_t outer, int64_t inner,
                int64_t* indices, void* values);
void cumsum(DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner, bool reverse,
            void* out);
void softmax(bool log, DType dtype, const void* in, int64_t outer, int64_t n, int64_t inner,
             void* out);

void index_select(DType dtype, const void* src, int64_t outer, int64_t n, int64_t inner,
                  const int64_t* idx, int64_t m, void* out);
void index_lines(IndexMode mode, const Shape& shape, int64_t dim, const Operand& idx,
                 const Operand& out, const Operand& src, double value);
void index_add(DType dtype, void* out, int64_t outer, int64_t n, int64_t inner, const int64_t* idx,
               int64_t m, const void* src, double alpha);
void checked_indices(const int64_t* idx, int64_t n, int64_t size, int64_t* safe,
                     DeviceErrorFlag* flag, int32_t check);

// conv_kernels.cpp, pool_kernels.cpp
void conv(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
          const void* bias, void* out);
void avg_pool(bool adjoint, DType dtype, const PoolWindow& g, const void* in, void* out);
void max_pool(DType dtype, const PoolWindow& g, const void* in, void* out, int64_t* indices);
void max_pool_route(bool scatter, DType dtype, const PoolWindow& g, const int64_t* indices,
                    const void* in, void* out);
void upsample_nearest2x(DType dtype, int64_t rows, int64_t W, const void* in, void* out);
void sq_dist_finish(DType dtype, const void* x, const void* c, int64_t n, int64_t k, int64_t d,
                    void* out);

// random_kernels
void random_fill(const RandomFill& f, int64_t n, void* out);

// optim_kernels
void sgd_step(const SgdStep& s, DType dtype, int64_t n, void* param, const void* grad,
              void* momentum_buffer);
void adam_step(const AdamStep& s, DType dtype, int64_t n, void* param, const void* grad,
               void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq);

}  // namespace quanta::cpu
