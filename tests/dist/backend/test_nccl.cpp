// The NCCL backend on one GPU. NCCL refuses two ranks on one device, and a
// ProcessGroup of one rank never calls its backend, so these tests drive the
// NCCL backend itself (made in the CUDA module) as a one-rank communicator:
// its rendezvous through the store, the non-blocking init with a deadline, and every collective on
// device memory (the multi-rank logic above the backend is the Gloo tests').
#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dist/backend/nccl_backend.h"
#include "dist/reduce_check.h"
#include "dist/store/store.h"
#include "engine/cuda/runtime.h"
#include "quant/nf4/nf4_format.h"
#include "quanta.h"
#include "support/gpu.h"

using namespace quanta;
using namespace quanta::dist;

namespace {

bool skip_without_gpu() {
  if (cuda_device_count() > 0) return false;
  MESSAGE("skipped: " << quanta::testing::no_gpu_reason());
  return true;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.nbytes() == y.nbytes() && std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

}  // namespace

TEST_CASE("nccl, one rank: init, then every reduction of all_reduce on device memory") {
  if (skip_without_gpu()) return;
  TcpStoreServer server(0);
  TcpStore store("127.0.0.1", server.port(), false, Millis(5000));
  auto nccl = dist::detail::make_nccl_backend(store, 0, 1, 0, Millis(60000));
  const Device gpu = Device::cuda(0);
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u8}) {
    for (ReduceOp op :
         {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod}) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      INFO(dtype_name(dt), " ", reduce_op_name(op));
      Tensor want = (arange(0.0, 12.0, 1.0, {.dtype = DType::f64}) + 1.0).to(dt);
      Tensor x = want.to(gpu);
      nccl->all_reduce(x.raw_data(), static_cast<std::size_t>(x.numel()), dt, op, /*tag=*/0,
                       Millis(20000));
      CHECK(same_bytes(x, want));  // one rank: every reduction is the identity
    }
  }
}

TEST_CASE("nccl, one rank: broadcast, all_gather and reduce_scatter; nf4 bytes travel") {
  if (skip_without_gpu()) return;
  TcpStoreServer server(0);
  TcpStore store("127.0.0.1", server.port(), false, Millis(5000));
  auto nccl = dist::detail::make_nccl_backend(store, 0, 1, 0, Millis(60000));
  const Device gpu = Device::cuda(0);
  Generator gen(7);
  Tensor w = randn({64, 128}, gen);
  Tensor q = quant::quantize_nf4(w);
  Tensor qg = q.to(gpu);
  nccl->broadcast(qg.raw_data(), qg.nbytes(), 0, /*tag=*/0, Millis(20000));
  CHECK(same_bytes(qg, q));
  CHECK(same_bytes(quant::dequantize(qg.to(Device::cpu())), quant::dequantize(q)));

  Tensor x = randn({4, 5}, gen).to(gpu);
  Tensor out = empty({4, 5}, {.device = gpu});
  nccl->all_gather(x.raw_data(), out.raw_data(), x.nbytes(), /*tag=*/0, Millis(20000));
  CHECK(same_bytes(out, x));
  Tensor rs = empty({4, 5}, {.device = gpu});
  nccl->reduce_scatter(x.raw_data(), rs.raw_data(), static_cast<std::size_t>(x.numel()), DType::f32,
                       ReduceOp::sum, /*tag=*/0, Millis(20000));
  CHECK(same_bytes(rs, x));
  // Through the interface ProcessGroup uses. all_gather_v and all_to_all are
  // grouped send/recv: with one rank, the own piece's device copy and an
  // empty NCCL group. A barrier is refused without touching the communicator.
  dist::detail::Backend& backend = *nccl;
  CHECK(std::string(backend.name()) == "nccl");
  std::vector<std::size_t> bytes{x.nbytes()};
  Tensor gathered = zeros({4, 5}, {.device = gpu});
  backend.all_gather_v(x.raw_data(), gathered.raw_data(), bytes, 0, Millis(20000));
  CHECK(same_bytes(gathered, x));
  Tensor swapped = zeros({4, 5}, {.device = gpu});
  backend.all_to_all(x.raw_data(), swapped.raw_data(), x.nbytes(), 0, Millis(20000));
  CHECK(same_bytes(swapped, x));
  CHECK_THROWS_AS(backend.barrier(0, Millis(20000)), std::invalid_argument);
  backend.all_reduce(x.raw_data(), static_cast<std::size_t>(x.numel()), DType::f32, ReduceOp::avg,
                     0, Millis(20000));
  CHECK(same_bytes(x, out));  // one rank: avg is the identity
}

TEST_CASE("nccl, one rank: all_reduce_checked reduces device data and a host check region") {
  if (skip_without_gpu()) return;
  TcpStoreServer server(0);
  TcpStore store("127.0.0.1", server.port(), false, Millis(5000));
  auto nccl = dist::detail::make_nccl_backend(store, 0, 1, 0, Millis(60000));
  dist::detail::Backend& backend = *nccl;
  const Device gpu = Device::cuda(0);
  Generator gen(9);
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      INFO(dtype_name(dt), " ", reduce_op_name(op));
      const Tensor want = (rand({3, 7}, gen, {.dtype = DType::f64}) * 100.0).to(dt);
      Tensor x = want.to(gpu);
      const uint32_t word = 0x5eed1234u;
      std::vector<char> region = dist::detail::check_region(word, dt);
      backend.all_reduce_checked(x.raw_data(), static_cast<std::size_t>(x.numel()), region.data(),
                                 dist::detail::kCheckElems, dt, op, /*tag=*/0, Millis(20000));
      CHECK(same_bytes(x, want));  // one rank: the identity
      CHECK(dist::detail::check_region_holds(region.data(), word, dt, op));
    }
  }
  // After a ready event (DataParallel's bucket) instead of the default
  // stream's present end; the scope restores none.
  {
    const std::shared_ptr<void> ready = cuda::record_event(0);
    const dist::detail::ReadyAfter after(ready.get());
    CHECK(dist::detail::ready_event() == ready.get());
    Tensor x = arange(0.0, 10.0, 1.0).to(gpu);
    std::vector<char> r = dist::detail::check_region(3, DType::f32);
    backend.all_reduce_checked(x.raw_data(), 10, r.data(), dist::detail::kCheckElems, DType::f32,
                               ReduceOp::sum, 0, Millis(20000));
    CHECK(same_bytes(x, arange(0.0, 10.0, 1.0)));
  }
  CHECK(dist::detail::ready_event() == nullptr);
  // Zero data elements: the region still travels.
  std::vector<char> region = dist::detail::check_region(7, DType::f32);
  backend.all_reduce_checked(nullptr, 0, region.data(), dist::detail::kCheckElems, DType::f32,
                             ReduceOp::sum, 0, Millis(20000));
  CHECK(dist::detail::check_region_holds(region.data(), 7, DType::f32, ReduceOp::sum));
}

TEST_CASE("nccl: the ready event is per thread and scoped (no GPU needed)") {
  CHECK(dist::detail::ready_event() == nullptr);
  int a = 0, b = 0;
  {
    const dist::detail::ReadyAfter outer(&a);
    CHECK(dist::detail::ready_event() == &a);
    {
      const dist::detail::ReadyAfter inner(&b);
      CHECK(dist::detail::ready_event() == &b);
      void* seen = &a;
      std::thread([&] { seen = dist::detail::ready_event(); }).join();
      CHECK(seen == nullptr);  // another thread has its own
    }
    CHECK(dist::detail::ready_event() == &a);
  }
  CHECK(dist::detail::ready_event() == nullptr);
}
