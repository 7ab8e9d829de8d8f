// CPU entry put_rows (quant/kernels/table.h): the codebook's in-place row
// writes of a dead-code step (only the replaced rows are touched).
#include "engine/dispatch.h"
#include "quant/cpu/kernels.h"

namespace quanta::quant::quant_cpu {

void put_rows(DType dtype, void* dst, int64_t d, const int64_t* at, int64_t m, const void* src,
              double scale) {
  dispatch_float(dtype, "Codebook", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* out = static_cast<T*>(dst);
    const T* in = static_cast<const T*>(src);
    for (int64_t i = 0; i < m; ++i) {
      T* row = out + at[i] * d;
      for (int64_t e = 0; e < d; ++e) row[e] = in ? T(scale) * in[i * d + e] : T(scale);
    }
  });
}

}  // namespace quanta::quant::quant_cpu
