// Built without CUDA: an NcclBackend that cannot be made. (ProcessGroup
// refuses CUDA tensors before it would make one: "[dist::<op>] CUDA tensor,
// but quanta was built without CUDA".)
#include <stdexcept>

#include "dist/nccl_backend.h"

namespace quanta::dist::detail {

struct NcclBackend::Impl {};
NcclBackend::NcclBackend(Store&, int, int, int, Millis) {
  throw std::invalid_argument("[dist] NCCL: quanta was built without CUDA");
}
NcclBackend::~NcclBackend() = default;
// Unreachable (the constructor throws); defined so callers link either way.
void NcclBackend::all_reduce(void*, std::size_t, DType, ReduceOp, uint32_t, Millis) {}
void NcclBackend::broadcast(void*, std::size_t, int, uint32_t, Millis) {}
void NcclBackend::all_gather(const void*, void*, std::size_t, uint32_t, Millis) {}
void NcclBackend::all_gather_v(const void*, void*, const std::vector<std::size_t>&, uint32_t,
                               Millis) {}
void NcclBackend::reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, uint32_t,
                                 Millis) {}
void NcclBackend::all_to_all(const void*, void*, std::size_t, uint32_t, Millis) {}
void NcclBackend::barrier(uint32_t, Millis) {}

}  // namespace quanta::dist::detail
