// Built without CUDA: the NCCL half of ProcessGroup only says so.
#include <stdexcept>

#include "dist/group_call.h"
#include "dist/nccl_backend.h"

namespace quanta::dist {
namespace detail {

struct NcclBackend::Impl {};
NcclBackend::NcclBackend(Store&, int, int, int, Millis) {
  throw std::invalid_argument("[dist] NCCL: quanta was built without CUDA");
}
NcclBackend::~NcclBackend() = default;
// Unreachable (the constructor throws); defined so callers link either way.
void NcclBackend::all_reduce(void*, std::size_t, DType, ReduceOp, Millis) {}
void NcclBackend::broadcast(void*, std::size_t, int, Millis) {}
void NcclBackend::all_gather(const void*, void*, std::size_t, Millis) {}
void NcclBackend::reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, Millis) {}

}  // namespace detail

namespace {
[[noreturn]] void no_cuda(const char* op) {
  throw std::invalid_argument(std::string("[dist::") + op +
                              "] CUDA tensor, but quanta was built without CUDA");
}
}  // namespace

void ProcessGroup::nccl_all_reduce(const Tensor&, ReduceOp, const Call&) { no_cuda("all_reduce"); }
void ProcessGroup::nccl_broadcast(const Tensor&, int, const Call&) { no_cuda("broadcast"); }
Tensor ProcessGroup::nccl_all_gather(const Tensor&, const Call&) { no_cuda("all_gather"); }
Tensor ProcessGroup::nccl_reduce_scatter(const Tensor&, ReduceOp, const Call&) {
  no_cuda("reduce_scatter");
}

}  // namespace quanta::dist
