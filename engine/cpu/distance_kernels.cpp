// The CPU's finishing pass of sq_dist: row norms, then the clamped sum over
// the products a GEMM left in the output.
#include <algorithm>

#include "engine/cpu/kernels.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/eigen.h"

namespace quanta::cpu {

void sq_dist_finish(DType dtype, const void* x, const void* c, int64_t n, int64_t k, int64_t d,
                    void* out) {
  dispatch_float(dtype, "sq_dist", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Rows = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
    Eigen::Map<const Rows> xm(static_cast<const T*>(x), n, d), cm(static_cast<const T*>(c), k, d);
    const Vec xn = xm.rowwise().squaredNorm(), cn = cm.rowwise().squaredNorm();
    T* o = static_cast<T*>(out);
    parallel_for(0, n, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(k, 1)),
                 [&](int64_t lo, int64_t hi) {
                   for (int64_t i = lo; i < hi; ++i) {
                     T* row = o + i * k;
                     for (int64_t j = 0; j < k; ++j)
                       row[j] = std::max(T(0), xn[i] + cn[j] - T(2) * row[j]);
                   }
                 });
  });
}

}  // namespace quanta::cpu
