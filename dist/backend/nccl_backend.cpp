// NCCL backend (compiled with CUDA only). See nccl_backend.h for the rules.
#include "dist/backend/nccl_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <thread>

#include "engine/cuda/stream.h"

namespace quanta::dist::detail {
namespace {

using Clock = std::chrono::steady_clock;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw DistError(std::string("[dist::nccl] ") + what + ": " + cudaGetErrorString(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
    case DType::boolean:  // bytes of 0 and 1: min and max (all, any) are exact
      return ncclUint8;
    default:
      break;
  }
  throw std::invalid_argument(std::string("[dist::nccl] no NCCL type for ") + dtype_name(t));
}

// Makes the backend's device current for one call and restores the
// caller's after: the calling thread (a DataParallel communication thread,
// a step hook) may have another current device, and an event or stream of
// one device cannot be used while another is current.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

[[noreturn]] void refuse(const char* op, const char* why) {
  throw std::invalid_argument(std::string("[dist::nccl] ") + op +
                              " is not available on NCCL: " + why);
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::prod:
      return ncclProd;
  }
  return ncclSum;
}

}  // namespace

struct NcclBackend::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
  int device = 0, rank = 0, size = 1;
  bool aborted = false;
  // all_reduce_checked's check region, in pinned host memory and on the
  // device: it travels on `stream` (see there).
  void* check_host = nullptr;
  void* check_device = nullptr;
  std::size_t check_capacity = 0;

  void reserve_check(std::size_t bytes) {
    if (bytes <= check_capacity) return;
    if (check_host) cudaFreeHost(check_host);
    if (check_device) cudaFree(check_device);
    check_host = check_device = nullptr;
    check_capacity = 0;
    cuda_check(cudaMallocHost(&check_host, bytes), "cudaMallocHost");
    cuda_check(cudaMalloc(&check_device, bytes), "cudaMalloc");
    check_capacity = bytes;
  }

  // Waits until the communicator is no longer in progress, aborting it at
  // the deadline or on an asynchronous error.
  void settle(Clock::time_point deadline, const char* what) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm, &st);
      if (st == ncclSuccess) return;
      if (st != ncclInProgress)
        abort_with(std::string(what) + ": " + ncclGetErrorString(st) + " (" +
                   ncclGetLastError(comm) + ")");
      if (Clock::now() > deadline) abort_with(std::string(what) + ": timed out");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  [[noreturn]] void abort_with(const std::string& why) {
    if (comm && !aborted) ncclCommAbort(comm);
    aborted = true;
    throw DistError("[dist::nccl] " + why + "; the communicator was aborted");
  }

  void enqueue_check(ncclResult_t r, Clock::time_point deadline, const char* what) {
    if (r == ncclInProgress)
      settle(deadline, what);
    else if (r != ncclSuccess)
      abort_with(std::string(what) + ": " + ncclGetErrorString(r));
  }

  // The watchdog loop: poll the completion event and the async error against
  // the deadline; never an unbounded stream synchronise.
  void watch(Clock::time_point deadline, const char* what) {
    cuda_check(cudaEventRecord(done, stream), "cudaEventRecord");
    for (;;) {
      const cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) cuda_check(q, what);
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm, &st);
      if (st != ncclSuccess && st != ncclInProgress)
        abort_with(std::string(what) + ": " + ncclGetErrorString(st));
      if (Clock::now() > deadline) abort_with(std::string(what) + ": timed out waiting for peers");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Work on our stream starts after the caller's ready event (ready_event():
  // DataParallel's bucket), else after everything already queued on the
  // device's quanta stream, where the engine's kernels run.
  void order_after_default() {
    if (void* e = ready_event()) {
      cuda_check(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(e), 0),
                 "cudaStreamWaitEvent");
      return;
    }
    cuda_check(cudaEventRecord(ready, cuda::stream()), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
  }

  // One point-to-point exchange with every other rank, as one NCCL group:
  // send_of(peer) and recv_of(peer) give the piece for that peer (bytes 0:
  // nothing moves, and the peer skips the matching call too, since every
  // rank knows every size). This rank's own piece is copied on the stream.
  struct Piece {
    const void* ptr;
    std::size_t bytes;
  };
  template <class SendOf, class RecvOf>
  void exchange(Clock::time_point deadline, const char* what, SendOf send_of, RecvOf recv_of) {
    order_after_default();
    const Piece own_in = send_of(rank), own_out = recv_of(rank);
    if (own_in.bytes != 0)
      cuda_check(cudaMemcpyAsync(const_cast<void*>(own_out.ptr), own_in.ptr, own_in.bytes,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync");
    enqueue_check(ncclGroupStart(), deadline, "ncclGroupStart");
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      const Piece out = send_of(peer), in = recv_of(peer);
      if (out.bytes != 0)
        enqueue_check(ncclSend(out.ptr, out.bytes, ncclUint8, peer, comm, stream), deadline,
                      "ncclSend");
      if (in.bytes != 0)
        enqueue_check(ncclRecv(const_cast<void*>(in.ptr), in.bytes, ncclUint8, peer, comm, stream),
                      deadline, "ncclRecv");
    }
    enqueue_check(ncclGroupEnd(), deadline, "ncclGroupEnd");
    watch(deadline, what);
  }
};

NcclBackend::NcclBackend(Store& store, int rank, int size, int device, Millis timeout)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.device = device;
  s.rank = rank;
  s.size = size;
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  // Two ranks on one GPU make NCCL fail obscurely: check it ourselves.
  char bus[64] = {};
  cuda_check(cudaDeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string me = std::string(host) + "/" + bus;
  store.set_string("nccl/gpu/" + std::to_string(rank), me);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    if (store.get_string("nccl/gpu/" + std::to_string(r), timeout) == me)
      throw DistError("[dist::nccl] ranks " + std::to_string(std::min(r, rank)) + " and " +
                      std::to_string(std::max(r, rank)) + " are both on GPU " + me +
                      ": NCCL needs one GPU per rank (--device cuda takes the GPU of each rank's "
                      "local rank; cuda:N is the same GPU on every rank)");
  }
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclGetUniqueId(&id) != ncclSuccess) throw DistError("[dist::nccl] ncclGetUniqueId failed");
    store.set("nccl/uid", Bytes(id.internal, id.internal + sizeof id.internal));
  }
  const Bytes uid = store.get("nccl/uid", timeout);
  std::memcpy(id.internal, uid.data(), sizeof id.internal);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  const auto deadline = Clock::now() + timeout;
  const ncclResult_t r = ncclCommInitRankConfig(&s.comm, size, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress)
    throw DistError(std::string("[dist::nccl] ncclCommInitRankConfig: ") + ncclGetErrorString(r));
  s.settle(deadline, "communicator init");
  cuda_check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), "cudaEventCreate");
}

NcclBackend::~NcclBackend() {
  Impl& s = *impl_;
  int previous = s.device;
  cudaGetDevice(&previous);
  cudaSetDevice(s.device);  // its events, stream and buffers are that device's
  // Abort rather than destroy: ncclCommDestroy may wait forever on peers.
  if (s.comm && !s.aborted) ncclCommAbort(s.comm);
  if (s.check_host) cudaFreeHost(s.check_host);
  if (s.check_device) cudaFree(s.check_device);
  if (s.done) cudaEventDestroy(s.done);
  if (s.ready) cudaEventDestroy(s.ready);
  if (s.stream) cudaStreamDestroy(s.stream);
  cudaSetDevice(previous);
}

void NcclBackend::all_reduce(void* data, std::size_t n, DType dtype, ReduceOp op, uint32_t,
                             Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout;
  s.order_after_default();
  s.enqueue_check(ncclAllReduce(data, data, n, nccl_type(dtype), nccl_op(op), s.comm, s.stream),
                  deadline, "ncclAllReduce");
  s.watch(deadline, "all_reduce");
}

// The check region comes from the host and goes back there through pinned
// memory, copied on this backend's stream: nothing is queued on the default
// stream, where a copy would first wait for every kernel queued before it
// (a DataParallel bucket's reduction would then wait for the backward work
// the main thread queued meanwhile instead of overlapping it), and the
// copies are watched against the deadline with the collectives.
void NcclBackend::all_reduce_checked(void* data, std::size_t n, void* check, std::size_t check_n,
                                     DType dtype, ReduceOp op, uint32_t, Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout;
  const std::size_t bytes = check_n * element_size(dtype);
  s.reserve_check(bytes);
  std::memcpy(s.check_host, check, bytes);
  s.order_after_default();
  cuda_check(cudaMemcpyAsync(s.check_device, s.check_host, bytes, cudaMemcpyHostToDevice, s.stream),
             "cudaMemcpyAsync");
  const ncclDataType_t type = nccl_type(dtype);
  const ncclRedOp_t red = nccl_op(op);
  s.enqueue_check(ncclGroupStart(), deadline, "ncclGroupStart");
  if (n != 0)
    s.enqueue_check(ncclAllReduce(data, data, n, type, red, s.comm, s.stream), deadline,
                    "ncclAllReduce");
  s.enqueue_check(
      ncclAllReduce(s.check_device, s.check_device, check_n, type, red, s.comm, s.stream), deadline,
      "ncclAllReduce");
  s.enqueue_check(ncclGroupEnd(), deadline, "ncclGroupEnd");
  cuda_check(cudaMemcpyAsync(s.check_host, s.check_device, bytes, cudaMemcpyDeviceToHost, s.stream),
             "cudaMemcpyAsync");
  s.watch(deadline, "all_reduce");
  std::memcpy(check, s.check_host, bytes);
}

void NcclBackend::broadcast(void* data, std::size_t bytes, int root, uint32_t, Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout;
  s.order_after_default();
  s.enqueue_check(ncclBroadcast(data, data, bytes, ncclUint8, root, s.comm, s.stream), deadline,
                  "ncclBroadcast");
  s.watch(deadline, "broadcast");
}

void NcclBackend::all_gather(const void* in, void* out, std::size_t bytes_per_rank, uint32_t,
                             Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout;
  s.order_after_default();
  s.enqueue_check(ncclAllGather(in, out, bytes_per_rank, ncclUint8, s.comm, s.stream), deadline,
                  "ncclAllGather");
  s.watch(deadline, "all_gather");
}

void NcclBackend::reduce_scatter(const void* in, void* out, std::size_t n_out, DType dtype,
                                 ReduceOp op, uint32_t, Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout;
  s.order_after_default();
  s.enqueue_check(
      ncclReduceScatter(in, out, n_out, nccl_type(dtype), nccl_op(op), s.comm, s.stream), deadline,
      "ncclReduceScatter");
  s.watch(deadline, "reduce_scatter");
}

void NcclBackend::reduce(void* data, std::size_t n, DType dtype, ReduceOp op, int root, uint32_t,
                         Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout;
  s.order_after_default();
  s.enqueue_check(ncclReduce(data, data, n, nccl_type(dtype), nccl_op(op), root, s.comm, s.stream),
                  deadline, "ncclReduce");
  s.watch(deadline, "reduce");
}

// NCCL has no collective for uneven pieces or all-to-all: both are grouped
// ncclSend/ncclRecv with every peer, device to device.
void NcclBackend::all_gather_v(const void* in, void* out, const std::vector<std::size_t>& bytes,
                               uint32_t, Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  std::vector<std::size_t> offset(bytes.size() + 1, 0);
  for (std::size_t r = 0; r < bytes.size(); ++r) offset[r + 1] = offset[r] + bytes[r];
  char* o = static_cast<char*>(out);
  const std::size_t mine = bytes[static_cast<std::size_t>(s.rank)];
  s.exchange(
      Clock::now() + timeout, "all_gather_v",
      [&](int) {
        return Impl::Piece{in, mine};
      },
      [&](int peer) {
        const auto p = static_cast<std::size_t>(peer);
        return Impl::Piece{o + offset[p], bytes[p]};
      });
}

void NcclBackend::all_to_all(const void* in, void* out, std::size_t total_bytes, uint32_t,
                             Millis timeout) {
  Impl& s = *impl_;
  const DeviceScope scope(s.device);
  const std::size_t block = total_bytes / static_cast<std::size_t>(s.size);
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  s.exchange(
      Clock::now() + timeout, "all_to_all",
      [&](int peer) {
        return Impl::Piece{i + static_cast<std::size_t>(peer) * block, block};
      },
      [&](int peer) {
        return Impl::Piece{o + static_cast<std::size_t>(peer) * block, block};
      });
}

void NcclBackend::barrier(uint32_t, Millis) {
  refuse("barrier", "a barrier has no tensor and runs on the group's Gloo transport");
}

}  // namespace quanta::dist::detail

// The entry libquanta's make_nccl_backend (dist/backend/nccl_module.cpp) looks up in
// libquanta_cuda, where this file is compiled.
extern "C" __attribute__((visibility("default"))) quanta::dist::detail::Backend*
quanta_nccl_backend_v1(quanta::dist::Store& store, int rank, int size, int device,
                       quanta::dist::Millis timeout) {
  return new quanta::dist::detail::NcclBackend(store, rank, size, device, timeout);
}
