// Finding and loading libquanta_cuda, and the runtime seam's forwarders.
// QUANTA_CUDA_MODULE (the module's file name) is defined by the build when
// the module is compiled; without it, every CUDA request says quanta was built
// without CUDA.
#include "engine/cuda/module.h"

#include <dlfcn.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "engine/cuda/caching_allocator.h"
#include "engine/cuda/module_table.h"
#include "engine/cuda/runtime.h"

namespace quanta {
namespace cuda {
namespace {

struct Loaded {
  const Module* module = nullptr;
  void* handle = nullptr;
  std::string reason;
};

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// Loads `path` (a file name alone goes through the loader's search path).
Loaded open_module(const std::string& path) {
  Loaded l;
  dlerror();
  l.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!l.handle) {
    l.reason = "the CUDA backend could not be loaded (" + dl_error() +
               "); CUDA's runtime libraries must be on the library path";
    return l;
  }
  using Entry = const Module* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(l.handle, "quanta_cuda_module_v1"));
  const Module* m = entry ? entry() : nullptr;
  if (!m || m->abi != Module::kAbi) {
    l.reason = "the CUDA backend " + path + " is not this quanta's (" +
               (m ? "module ABI " + std::to_string(m->abi) : std::string("no entry point")) +
               ", expected ABI " + std::to_string(Module::kAbi) + ")";
    dlclose(l.handle);
    l.handle = nullptr;
    return l;
  }
  l.module = m;
  return l;
}

#ifdef QUANTA_CUDA_MODULE
// The directory of the object holding this function: libquanta's own, where
// the build and `meson install` both put the module beside it.
std::filesystem::path own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&own_directory), &info) == 0 || !info.dli_fname) return {};
  return std::filesystem::path(info.dli_fname).parent_path();
}
#endif

const Loaded& loaded() {
  static const Loaded l = []() -> Loaded {
#ifndef QUANTA_CUDA_MODULE
    return {.reason =
                "quanta was built without CUDA (reconfigure with -Dcuda=enabled on a "
                "machine with nvcc)"};
#else
    // An explicit path (packagers, tests) wins over the search.
    if (const char* env = std::getenv("QUANTA_CUDA_MODULE"); env && *env) return open_module(env);
    const std::filesystem::path beside = own_directory() / QUANTA_CUDA_MODULE;
    std::error_code ec;
    return open_module(std::filesystem::exists(beside, ec) ? beside.string()
                                                           : std::string(QUANTA_CUDA_MODULE));
#endif
  }();
  return l;
}

const Module& need(const char* op) {
  if (const Module* m = module()) return *m;
  throw std::runtime_error(std::string("[") + op + "] " + unavailable_reason());
}

}  // namespace

const Module* module() { return loaded().module; }

const std::string& unavailable_reason() { return loaded().reason; }

void* module_symbol(const char* op, const char* name) {
  need(op);
  void* sym = dlsym(loaded().handle, name);
  if (!sym)
    throw std::runtime_error(std::string("[") + op + "] the CUDA backend has no " + name +
                             " (a module from another quanta version?)");
  return sym;
}

void no_cuda_kernel(const char* op, const std::string& reason, const char* kind) {
  throw std::runtime_error(std::string("[") + op + "] has no CUDA kernel here: " +
                           (reason.empty()
                                ? std::string("the CUDA module's ") + kind + " table is not in use"
                                : reason) +
                           "; move the tensors to cpu");
}

std::string try_load(const std::string& path) {
  Loaded l = open_module(path);
  if (l.handle) dlclose(l.handle);
  return l.reason;
}

namespace {
// Never destroyed: at exit the CUDA runtime may already be gone, and the
// driver takes the process's memory back anyway.
CachingAllocator& device_cache() {
  static CachingAllocator* cache = new CachingAllocator({
      .malloc = [](std::size_t n,
                   int d) { return need("cuda::device_malloc").device_malloc(n, d); },
      .free = [](void* p, int d) { module()->device_free(p, d); },
  });
  return *cache;
}
}  // namespace

void* device_malloc(std::size_t nbytes, int device) {
  need("cuda::device_malloc");
  return device_cache().allocate(nbytes, device);
}

void device_free(void* ptr, int device) noexcept {
  if (module()) device_cache().deallocate(ptr, device);
}

void set_device(int device) { need("cuda::set_device").set_device(device); }

void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t nbytes) {
  need("cuda::copy").copy(dst, dst_device, src, src_device, nbytes);
}

void synchronize(int device) { need("cuda::synchronize").synchronize(device); }

void* mapped_host_alloc(std::size_t nbytes) {
  return need("cuda::mapped_host_alloc").mapped_host_alloc(nbytes);
}

ConvPaths conv_paths() { return need("cuda::conv_paths").conv_paths(); }

void set_nondeterministic_conv(bool allowed) {
  need("cuda::set_nondeterministic_conv").set_nondeterministic_conv(allowed);
}

namespace {
// What libquanta keeps of a CUDA graph: the module's graph and the pool
// its capture allocated from.
struct CapturedGraph {
  void* graph = nullptr;
  uint64_t pool = 0;
};
// The pool of the capture open on each device.
std::mutex open_pools_mutex;
std::map<int, uint64_t> open_pools;
}  // namespace

void begin_capture(int device) {
  const Module& m = need("DeviceGraph");
  const uint64_t pool = device_cache().open_pool(device);
  try {
    m.begin_capture(device);
  } catch (...) {
    device_cache().close_pool(device);
    device_cache().release_pool(pool);
    throw;
  }
  std::lock_guard<std::mutex> lock(open_pools_mutex);
  open_pools[device] = pool;
}

void* end_capture(int device) {
  uint64_t pool = 0;
  {
    std::lock_guard<std::mutex> lock(open_pools_mutex);
    pool = open_pools.at(device);
    open_pools.erase(device);
  }
  device_cache().close_pool(device);
  void* graph = nullptr;
  try {
    graph = need("DeviceGraph").end_capture(device);
  } catch (...) {
    device_cache().release_pool(pool);
    throw;
  }
  return new CapturedGraph{graph, pool};
}

void launch_graph(void* graph, int device) {
  need("DeviceGraph").launch_graph(static_cast<CapturedGraph*>(graph)->graph, device);
}

int64_t graph_nodes(const void* graph) {
  return need("DeviceGraph").graph_nodes(static_cast<const CapturedGraph*>(graph)->graph);
}

void destroy_graph(void* graph) noexcept {
  auto* g = static_cast<CapturedGraph*>(graph);
  if (!g) return;
  // The module's destroy waits for the queued replays, so the pool's blocks
  // are free to hand out after it.
  if (module()) module()->destroy_graph(g->graph);
  if (module()) device_cache().release_pool(g->pool);
  delete g;
}

std::shared_ptr<void> record_event(int device) {
  const Module& m = need("cuda::record_event");
  return std::shared_ptr<void>(m.record_event(device), m.release_event);
}

}  // namespace cuda

bool cuda_built() {
#ifdef QUANTA_CUDA_MODULE
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
  const cuda::Module* m = cuda::module();
  return m ? m->device_count() : 0;
}

MemoryStats cuda_memory_stats(int device) {
  return cuda::module() ? cuda::device_cache().stats(device) : MemoryStats{};
}

void cuda_empty_cache() {
  if (cuda::module()) cuda::device_cache().empty_cache();
}

void cuda_reset_peak_memory_stats(int device) {
  if (cuda::module()) cuda::device_cache().reset_peak_stats(device);
}

}  // namespace quanta
