#include "engine/cpu/onednn.h"

#ifdef QUANTA_GEMM_ONEDNN
namespace quanta::cpu {

dnnl::engine& onednn_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& onednn_stream() {
  thread_local dnnl::stream stream(onednn_engine());
  return stream;
}

bool onednn_on_openmp() { return dnnl_version()->cpu_runtime == DNNL_RUNTIME_OMP; }

}  // namespace quanta::cpu
#endif
