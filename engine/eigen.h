#pragma once
// Eigen, for every file of quanta: include this, never <Eigen/...> directly.
// Once Eigen's AVX-512 packet code is inlined into quanta's kernels, GCC 12
// reports -Wmaybe-uninitialized (and -Wuninitialized) inside its own
// intrinsics headers: hundreds per build, all in avx512fintrin.h, where an
// intrinsic starts from an undefined vector on purpose; none in quanta's code. They are
// silenced for Eigen's code only, so that quanta's own warnings stay visible
// and CI can fail on them.
// Eigen never starts threads of its own: its parallel GEMM waits for them by
// spinning, which stalls on a busy machine. quanta's kernels split the work
// over its OpenMP threads instead (engine/cpu/gemm.cpp).
#define EIGEN_DONT_PARALLELIZE
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#pragma GCC diagnostic pop
