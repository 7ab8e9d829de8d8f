// CUDA memory and copies, and the module's one exported entry point
// (engine/cuda/module.h): libquanta reaches everything in libquanta_cuda
// through quanta_cuda_module_v1. libquanta's caching allocator sits over
// device_malloc; every kernel and every copy runs on the device's one quanta
// stream (engine/cuda/stream.h), which is what makes its reuse of blocks safe.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/blas_handle.h"
#include "engine/cuda/check.cuh"
#include "engine/cuda/cudnn_conv.h"
#include "engine/cuda/module.h"
#include "engine/cuda/staging.h"
#include "engine/cuda/stream.h"
#include "engine/cuda/upload_ring.h"
#include "engine/kernels/table.h"

namespace quanta::cuda {
namespace {

int device_count() {
  int n = 0;
  // No driver or no GPU is not an error here: it means zero devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void check_device(int device) {
  const int n = device_count();
  if (device < 0 || device >= n)
    throw std::runtime_error("[cuda] device cuda:" + std::to_string(device) +
                             " is not available (" + std::to_string(n) + " CUDA devices visible)");
}

// The first time a device is used: the stream-ordered pool that kernels'
// scratch buffers come from (cudaMallocAsync) keeps what it was given. Its
// default release threshold, 0, hands every byte back to the driver at each
// synchronisation, so each step's scratch would be a fresh driver allocation.
void prepare_device(int device) {
  static std::mutex mutex;
  static std::map<int, bool> prepared;
  std::lock_guard<std::mutex> lock(mutex);
  if (prepared[device]) return;
  cudaMemPool_t pool = nullptr;
  QUANTA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t keep = UINT64_MAX;
  QUANTA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  prepared[device] = true;
}

}  // namespace

cudaStream_t stream_of(int device) {
  // A fixed table: stream() is read at every launch, so no lock on the way.
  constexpr int kMaxDevices = 64;
  static std::atomic<cudaStream_t> streams[kMaxDevices] = {};
  static std::mutex mutex;
  if (device < 0 || device >= kMaxDevices)
    throw std::runtime_error("[cuda] device cuda:" + std::to_string(device) + " is past the " +
                             std::to_string(kMaxDevices) + " quanta supports");
  cudaStream_t s = streams[device].load(std::memory_order_acquire);
  if (s) return s;
  std::lock_guard<std::mutex> lock(mutex);
  s = streams[device].load(std::memory_order_relaxed);
  if (s) return s;
  int before = -1;
  QUANTA_CUDA_CHECK(cudaGetDevice(&before));
  QUANTA_CUDA_CHECK(cudaSetDevice(device));
  // Blocking (not cudaStreamNonBlocking): ordered with stream 0, see stream.h.
  const cudaError_t r = cudaStreamCreateWithFlags(&s, cudaStreamDefault);
  cudaSetDevice(before);
  QUANTA_CUDA_CHECK(r);
  streams[device].store(s, std::memory_order_release);
  return s;
}

cudaStream_t stream() {
  int device = 0;
  QUANTA_CUDA_CHECK(cudaGetDevice(&device));
  return stream_of(device);
}

bool capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  QUANTA_CUDA_CHECK(cudaStreamIsCapturing(stream_of(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

namespace {

void set_device(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
  check_device(device);
  QUANTA_CUDA_CHECK(cudaSetDevice(device));
  prepare_device(device);
}

// cudaMalloc in relaxed capture mode: while this thread captures a graph
// (its step's first pass meets sizes the cache has never held), the
// thread-local mode the capture runs in forbids cudaMalloc and would end the
// capture; relaxed allows it, and the block is not freed while a graph that
// was given it lives (the caching allocator's pools), as the rule asks.
cudaError_t malloc_even_capturing(void** p, std::size_t nbytes) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  QUANTA_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t r = cudaMalloc(p, nbytes);
  QUANTA_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  return r;
}

void* device_malloc(std::size_t nbytes, int device) {
  check_device(device);
  QUANTA_CUDA_CHECK(cudaSetDevice(device));
  prepare_device(device);
  void* p = nullptr;
  cudaError_t r = malloc_even_capturing(&p, nbytes);
  if (r == cudaErrorMemoryAllocation && !capturing(device)) {
    // The stream-ordered pool behind kernels' scratch keeps what it was
    // given (prepare_device), and destroyed graphs' memory nodes may still
    // hold theirs: hand both back to the driver once (after the stream has
    // finished with them) before saying the device is full.
    cudaGetLastError();
    cudaMemPool_t pool = nullptr;
    QUANTA_CUDA_CHECK(cudaStreamSynchronize(stream_of(device)));
    QUANTA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    QUANTA_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
    QUANTA_CUDA_CHECK(cudaDeviceGraphMemTrim(device));
    r = malloc_even_capturing(&p, nbytes);
  }
  if (r != cudaSuccess) {
    // cudaMalloc leaves its error as the thread's last error: the caching
    // allocator may retry and succeed, and the next launch check
    // (cudaGetLastError) would then report a false out-of-memory.
    cudaGetLastError();
    throw std::runtime_error("[cuda] cudaMalloc of " + std::to_string(nbytes) + " bytes on cuda:" +
                             std::to_string(device) + " failed: " + cudaGetErrorString(r));
  }
  return p;
}

void device_free(void* ptr, int device) noexcept {
  cudaSetDevice(device);
  cudaFree(ptr);
}

void synchronize(int device) {
  set_device(device);
  QUANTA_CUDA_CHECK(cudaDeviceSynchronize());
}

void* record_event(int device) {
  set_device(device);
  cudaEvent_t e = nullptr;
  QUANTA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const cudaError_t r = cudaEventRecord(e, stream_of(device));
  if (r != cudaSuccess) cudaEventDestroy(e);
  QUANTA_CUDA_CHECK(r);
  return e;
}

void release_event(void* event) noexcept { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

// A captured graph and what runs it.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::size_t nodes = 0;
  int device = 0;
};

void begin_capture(int device) {
  set_device(device);
  // Library handles are made on first use, and making one allocates and
  // synchronises: a capture cannot, so they exist before it starts.
  blas_handle();
  prepare_cudnn();
  // Thread-local: another thread's unsafe call (a cudaMalloc for its own
  // work) does not break this capture; this thread's does, loudly.
  QUANTA_CUDA_CHECK(cudaStreamBeginCapture(stream_of(device), cudaStreamCaptureModeThreadLocal));
}

void* end_capture(int device) {
  set_device(device);
  cudaGraph_t g = nullptr;
  const cudaError_t r = cudaStreamEndCapture(stream_of(device), &g);
  if (r != cudaSuccess || !g) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();  // the capture's error is reported here, not at the next launch
    throw std::runtime_error(
        std::string("[DeviceGraph] the capture on cuda:") + std::to_string(device) +
        " failed: " + cudaGetErrorString(r) +
        " (work on another stream or stream 0, or a call that synchronises, ran while "
        "capturing)");
  }
  auto* out = new Graph{g, nullptr, 0, device};
  cudaGraphGetNodes(g, nullptr, &out->nodes);
  const cudaError_t ri = cudaGraphInstantiate(&out->exec, g, 0);
  if (ri != cudaSuccess) {
    cudaGraphDestroy(g);
    delete out;
    cudaGetLastError();
    throw std::runtime_error(std::string("[DeviceGraph] cudaGraphInstantiate on cuda:") +
                             std::to_string(device) + " failed: " + cudaGetErrorString(ri));
  }
  return out;
}

void launch_graph(void* graph, int device) {
  set_device(device);
  QUANTA_CUDA_CHECK(cudaGraphLaunch(static_cast<Graph*>(graph)->exec, stream_of(device)));
}

int64_t graph_nodes(const void* graph) {
  return static_cast<int64_t>(static_cast<const Graph*>(graph)->nodes);
}

// Rare (a new batch shape, the end of a run): the launches still queued
// finish first, so nothing runs a graph that is gone.
void destroy_graph(void* graph) noexcept {
  auto* g = static_cast<Graph*>(graph);
  if (!g) return;
  if (g->exec) {
    int before = -1;
    cudaGetDevice(&before);
    cudaSetDevice(g->device);
    cudaStreamSynchronize(stream_of(g->device));
    cudaGetLastError();  // a kernel's failure is reported by the next read
    if (before >= 0) cudaSetDevice(before);
  }
  if (g->exec) cudaGraphExecDestroy(g->exec);
  if (g->graph) cudaGraphDestroy(g->graph);
  delete g;
}

void* mapped_host_alloc(std::size_t nbytes) {
  void* p = nullptr;
  QUANTA_CUDA_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(p, 0, nbytes);
  return p;
}

// True for host memory the DMA engine can read directly (cudaHostAlloc,
// cudaHostRegister); malloc'd memory is "unregistered".
bool host_pinned(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

// Events belong to the current device: a copy on `d`'s stream makes it
// current, and the caller's current device is back on return, as
// cudaMemcpy would leave it.
struct CurrentDevice {
  int before = -1;
  explicit CurrentDevice(int d) {
    if (cudaGetDevice(&before) != cudaSuccess) before = -1;
    set_device(d);
  }
  ~CurrentDevice() {
    if (before >= 0) cudaSetDevice(before);
  }
};

// One device's two pinned staging buffers and the events that say when the
// DMA last queued on each is over. Made at the first large copy and kept
// for the process (2 x 4 MiB of pinned host memory per device that copies).
struct Staging {
  std::mutex m;
  void* buffer[kStagingBuffers] = {};
  cudaEvent_t done[kStagingBuffers] = {};
};

// Never destroyed, like the allocator's cache: at exit the runtime may be gone.
Staging& staging(int device) {
  static std::mutex m;
  static auto* all = new std::map<int, Staging>();
  std::lock_guard<std::mutex> lock(m);
  return (*all)[device];
}

// A copy between pageable host memory and `device` through the staging
// buffers, chunk by chunk on the device's stream (where every kernel runs): the copy is ordered
// after the kernels that wrote the source or last used the destination's block, as the caching
// allocator's reuse rule asks. While the DMA moves one chunk the host memcpy fills or drains the
// other buffer. Synchronous on return, like cudaMemcpy: the caller may free or read its host
// memory.
void staged_copy(void* dst, const void* src, std::size_t nbytes, int device, bool to_device) {
  CurrentDevice current(device);
  Staging& s = staging(device);
  std::lock_guard<std::mutex> lock(s.m);
  for (int b = 0; b < kStagingBuffers; ++b)
    if (!s.buffer[b]) {
      QUANTA_CUDA_CHECK(cudaHostAlloc(&s.buffer[b], kStagingChunkBytes, cudaHostAllocDefault));
      QUANTA_CUDA_CHECK(cudaEventCreateWithFlags(&s.done[b], cudaEventDisableTiming));
    }
  const cudaStream_t stream = stream_of(device);
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  const std::vector<StagedChunk> plan = staging_plan(nbytes);
  if (to_device) {
    for (const StagedChunk& c : plan) {
      // The DMA that last read this buffer (two chunks ago) must be over.
      QUANTA_CUDA_CHECK(cudaEventSynchronize(s.done[c.buffer]));
      std::memcpy(s.buffer[c.buffer], in + c.offset, c.bytes);
      QUANTA_CUDA_CHECK(cudaMemcpyAsync(out + c.offset, s.buffer[c.buffer], c.bytes,
                                        cudaMemcpyHostToDevice, stream));
      QUANTA_CUDA_CHECK(cudaEventRecord(s.done[c.buffer], stream));
    }
    QUANTA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  // Device to host: queue chunk i + 1 into the other buffer (drained in the
  // previous round), then wait for chunk i and drain it.
  auto queue = [&](const StagedChunk& c) {
    QUANTA_CUDA_CHECK(cudaMemcpyAsync(s.buffer[c.buffer], in + c.offset, c.bytes,
                                      cudaMemcpyDeviceToHost, stream));
    QUANTA_CUDA_CHECK(cudaEventRecord(s.done[c.buffer], stream));
  };
  if (!plan.empty()) queue(plan[0]);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    if (i + 1 < plan.size()) queue(plan[i + 1]);
    const StagedChunk& c = plan[i];
    QUANTA_CUDA_CHECK(cudaEventSynchronize(s.done[c.buffer]));
    std::memcpy(out + c.offset, s.buffer[c.buffer], c.bytes);
  }
}

// One device's ring of pinned memory for queued uploads (upload_ring.h) and
// an event per upload still queued, oldest first.
struct Uploads {
  std::mutex m;
  void* buffer = nullptr;
  UploadRing ring;
  std::deque<std::pair<uint64_t, cudaEvent_t>> queued;
  std::vector<cudaEvent_t> spare;
};

// Never destroyed, like the staging buffers.
Uploads& uploads(int device) {
  static std::mutex m;
  static auto* all = new std::map<int, Uploads>();
  std::lock_guard<std::mutex> lock(m);
  return (*all)[device];
}

// A host-to-device copy that returns before the DMA: the bytes are copied
// into the ring (the caller may reuse its memory at once) and the transfer is
// queued on the device's stream, in order with the kernels before and after
// it. The host waits only when the ring comes round to a transfer still
// queued.
void queued_upload(void* dst, const void* src, std::size_t nbytes, int device) {
  CurrentDevice current(device);
  Uploads& u = uploads(device);
  std::lock_guard<std::mutex> lock(u.m);
  if (!u.buffer)
    QUANTA_CUDA_CHECK(cudaHostAlloc(&u.buffer, kUploadRingBytes, cudaHostAllocDefault));
  const UploadSpan span = u.ring.reserve(nbytes);
  while (!u.queued.empty() && u.queued.front().first <= span.wait_for) {
    const auto [seq, done] = u.queued.front();
    u.queued.pop_front();
    // The newest overlapped upload; the older ones ended before it.
    if (seq == span.wait_for) QUANTA_CUDA_CHECK(cudaEventSynchronize(done));
    u.spare.push_back(done);
  }
  char* slot = static_cast<char*>(u.buffer) + span.offset;
  std::memcpy(slot, src, nbytes);
  QUANTA_CUDA_CHECK(cudaMemcpyAsync(dst, slot, nbytes, cudaMemcpyHostToDevice, stream_of(device)));
  cudaEvent_t done = nullptr;
  if (u.spare.empty()) {
    QUANTA_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  } else {
    done = u.spare.back();
    u.spare.pop_back();
  }
  QUANTA_CUDA_CHECK(cudaEventRecord(done, stream_of(device)));
  u.queued.emplace_back(span.seq, done);
}

void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t nbytes) {
  if (dst_device.is_cuda()) check_device(dst_device.index);
  if (src_device.is_cuda()) check_device(src_device.index);
  // Uploads up to a few MiB (batches, scalars, drawn indices) are queued, so
  // a step never waits for its own inputs; pinned or not, they pass through
  // the ring, since the caller may rewrite its memory on return.
  if (src_device.is_cpu() && dst_device.is_cuda() && nbytes > 0 && nbytes <= kAsyncUploadMaxBytes)
    return queued_upload(dst, src, nbytes, dst_device.index);
  // Other small copies skip even the pointer query: they stay plain cudaMemcpy.
  const bool large = nbytes >= kStagingThresholdBytes;
  if (large && src_device.is_cpu() && dst_device.is_cuda() && use_staging(nbytes, host_pinned(src)))
    return staged_copy(dst, src, nbytes, dst_device.index, true);
  if (large && src_device.is_cuda() && dst_device.is_cpu() && use_staging(nbytes, host_pinned(dst)))
    return staged_copy(dst, src, nbytes, src_device.index, false);
  // On one GPU: queued on its stream (a captured step's copies are recorded).
  if (src_device.is_cuda() && dst_device == src_device) {
    CurrentDevice current(src_device.index);
    QUANTA_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream_of(src_device.index)));
    return;
  }
  // The rest (small reads to the host, large unstaged copies, one GPU to
  // another) wait: cudaMemcpy runs on the current device's legacy stream,
  // which waits for that device's quanta stream (blocking) and no other
  // device's, so the device whose kernels made the source is made current,
  // and a destination on another GPU first finishes what its stream queued.
  if (src_device.is_cuda() && dst_device.is_cuda())
    QUANTA_CUDA_CHECK(cudaStreamSynchronize(stream_of(dst_device.index)));
  CurrentDevice current(src_device.is_cuda() ? src_device.index : dst_device.index);
  QUANTA_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault));
}

}  // namespace
}  // namespace quanta::cuda

extern "C" __attribute__((visibility("default"))) const quanta::cuda::Module*
quanta_cuda_module_v1() {
  using namespace quanta::cuda;
  static const Module m{
      .abi = Module::kAbi,
      .device_count = device_count,
      .device_malloc = device_malloc,
      .device_free = device_free,
      .set_device = set_device,
      .copy = copy,
      .kernels = cuda_kernels,
      .synchronize = synchronize,
      .record_event = record_event,
      .release_event = release_event,
      .mapped_host_alloc = mapped_host_alloc,
      .conv_paths = conv_paths_taken,
      .set_nondeterministic_conv = set_cudnn_nondeterministic,
      .begin_capture = begin_capture,
      .end_capture = end_capture,
      .launch_graph = launch_graph,
      .graph_nodes = graph_nodes,
      .destroy_graph = destroy_graph,
  };
  return &m;
}
