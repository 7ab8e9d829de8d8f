#pragma once
// The CUDA backend is a module of its own, libquanta_cuda.so, which libquanta
// loads (dlopen) the first time a CUDA device is used. libquanta itself never
// links the CUDA runtime, cuBLAS or NCCL: a library built on a machine with
// nvcc loads on one without CUDA, runs everything on the CPU, and names the
// missing piece when asked for a GPU. The module is found beside libquanta
// (its own directory, then the loader's search path).
//
// Everything CUDA passes through here: the runtime seam (engine/cuda/runtime.h
// forwards to it), the kernel table, and symbols other layers look up by name
// (dist's NCCL backend, quant's CUDA table), so dependencies still
// point one way (quant -> dist -> engine).
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/device.h"

namespace quanta {
struct KernelTable;
}

namespace quanta::cuda {

/** Convolutions run by the CUDA conv entry, by path: cuDNN, or im2col +
 * cuBLAS (what cuDNN refuses, and everything in a build without cuDNN). */
struct ConvPaths {
  bool cudnn_linked = false;  // the module was built with cuDNN
  int64_t cudnn = 0;
  int64_t im2col = 0;
};

/** What libquanta_cuda offers, returned by its one exported entry point
 * `quanta_cuda_module_v1`. kAbi versions everything libquanta reaches in
 * the module: this struct, the engine's KernelTable and the tables found by
 * name in a module that passed this check (module_symbol: the quantizers'
 * QuantKernelTable, the language models' LlmKernelTable, dist's NCCL
 * backend), so it is the one ABI check for all of them. A new field, a
 * changed signature or a changed meaning in any of them bumps it. */
struct Module {
  // What each version changed is in git's history of this line.
  static constexpr int kAbi = 24;
  int abi = kAbi;
  int (*device_count)() = nullptr;
  void* (*device_malloc)(std::size_t nbytes, int device) = nullptr;
  void (*device_free)(void* ptr, int device) noexcept = nullptr;
  void (*set_device)(int device) = nullptr;
  void (*copy)(void* dst, Device dst_device, const void* src, Device src_device,
               std::size_t nbytes) = nullptr;
  const KernelTable& (*kernels)() = nullptr;
  void (*synchronize)(int device) = nullptr;
  /** A new CUDA event recorded on `device`'s default stream (a cudaEvent_t). */
  void* (*record_event)(int device) = nullptr;
  /** Destroys an event from record_event. Never throws. */
  void (*release_event)(void* event) noexcept = nullptr;
  /** nbytes of zeroed pinned host memory that every GPU's kernels may write
   * (cudaHostAllocMapped | Portable; one address on both sides), never freed. */
  void* (*mapped_host_alloc)(std::size_t nbytes) = nullptr;
  /** How many convolutions each path has run, on every GPU, since the module
   * was loaded (engine/cuda/cudnn_conv.h). */
  ConvPaths (*conv_paths)() = nullptr;
  /** Whether cuDNN may choose nondeterministic convolution algorithms. */
  void (*set_nondeterministic_conv)(bool allowed) = nullptr;
  /** Graphs (engine/capture/device_graph.h): begin_capture starts capturing
   * `device`'s stream on this thread (cudaStreamCaptureModeThreadLocal);
   * end_capture ends it and returns the instantiated graph, or throws
   * naming what broke the capture; launch_graph queues it on the stream;
   * graph_nodes counts its kernels, copies and memory nodes;
   * destroy_graph frees it (never throws). */
  void (*begin_capture)(int device) = nullptr;
  void* (*end_capture)(int device) = nullptr;
  void (*launch_graph)(void* graph, int device) = nullptr;
  int64_t (*graph_nodes)(const void* graph) = nullptr;
  void (*destroy_graph)(void* graph) noexcept = nullptr;
};

/** The loaded module, or nullptr when quanta was built without CUDA or the
 * module cannot be loaded (unavailable_reason() says which). Loads once. */
const Module* module();

/** Why module() is null ("" when it is loaded). */
const std::string& unavailable_reason();

/** Symbol `name` of the loaded module (an `extern "C"` entry such as dist's
 * `quanta_nccl_backend_v1`); throws std::runtime_error naming `op`, the
 * symbol and unavailable_reason() when it cannot be had. */
void* module_symbol(const char* op, const char* name);

/** Loads the module at `path` without caching it; "" on success, else the
 * loader's reason. For tests of the failure paths. */
std::string try_load(const std::string& path);

}  // namespace quanta::cuda
