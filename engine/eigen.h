#pragma once
// Eigen, for every file of quanta: include this, never <Eigen/...> directly.
// Once Eigen's AVX-512 packet code is inlined into quanta's kernels, GCC 12
// reports -Wmaybe-uninitialized (and -Wuninitialized) inside its own
// intrinsics headers: hundreds per build, all in avx512fintrin.h, where an
// intrinsic starts from an undefined vector on purpose; none in quanta's code. They are
// silenced for Eigen's code only, so that quanta's own warnings stay visible
// and CI can fail on them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#pragma GCC diagnostic pop
