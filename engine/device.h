#pragma once
// Where a tensor's bytes live: the CPU, one CUDA device, or one `sim` device
// (a stand-in for a GPU that every machine has: host memory of its own, the
// CPU's kernels, and every host-side rule of a GPU; engine/sim/sim_device.h).
#include <cstddef>
#include <cstdint>
#include <string>

namespace quanta {

enum class DeviceType : uint8_t { cpu, cuda, sim };

/** A device: cpu, or cuda or sim with an ordinal. */
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  /** The simulated GPU number i: results equal the CPU's bit for bit, while
   * its tensors obey a GPU's rules (no mixing with CPU tensors, every read
   * from the host a counted device-to-host copy). */
  static Device sim(int i = 0) { return {DeviceType::sim, i}; }
  /** Parses "cpu", "cuda", "cuda:1", "sim", "sim:1"; throws std::invalid_argument. */
  static Device parse(const std::string& s);

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool is_sim() const { return type == DeviceType::sim; }
  /** "cpu", "cuda:N" or "sim:N". */
  std::string str() const;
  bool operator==(const Device&) const = default;
};

/** What crossed between the host and one device since the start (or
 * reset_device_stats). A host sync is a point where the host waits for the
 * device: every device-to-host copy (item(), to_vector(), to(cpu), printing,
 * saving, a bounds check that reads indices back). Counted for cuda and sim
 * devices; the CPU has none. */
struct DeviceStats {
  int64_t host_syncs = 0;
  int64_t copies_to_host = 0;
  int64_t copies_from_host = 0;
  int64_t copies_on_device = 0;  // device to device
  int64_t bytes_to_host = 0;
  int64_t bytes_from_host = 0;
  int64_t allocations = 0;      // sim only: buffers taken (CUDA: cuda_memory_stats)
  int64_t allocated_bytes = 0;  // sim only: held by live tensors
  int64_t peak_allocated_bytes = 0;
};

/** Counters of `device` (all zero for the CPU). */
DeviceStats device_stats(Device device);
/** Host syncs of every device since the process started (never reset). */
int64_t host_sync_count();
/** Restarts the counters of `device` (live allocations stay counted). */
void reset_device_stats(Device device);

/** Waits until every kernel and copy queued on `device` has finished, and
 * throws what a queued kernel reported (nothing to wait for on the CPU).
 * Not a host sync in device_stats: it moves no data. Timing a device's work
 * needs it; reading a result does not (every read waits by itself). */
void synchronize(Device device);

/** True when quanta was compiled with its CUDA backend. */
bool cuda_built();
/** Number of visible CUDA devices (0 without CUDA or without a GPU). */
int cuda_device_count();

/** A CUDA device's memory as quanta's caching allocator sees it
 * (engine/cuda/caching_allocator.h). Sizes are in bytes, rounded up to the
 * allocator's size classes. */
struct MemoryStats {
  std::size_t allocated_bytes = 0;       // held by live tensors
  std::size_t peak_allocated_bytes = 0;  // since the start or reset_peak_memory_stats
  std::size_t reserved_bytes = 0;        // taken from the device: allocated + cached
  std::size_t peak_reserved_bytes = 0;
  int64_t allocations = 0;     // requests served
  int64_t cache_hits = 0;      // of which served from the cache
  int64_t device_mallocs = 0;  // cudaMalloc calls
  int64_t device_frees = 0;    // cudaFree calls (empty_cache, out-of-memory retries)
  int64_t oom_retries = 0;     // allocations retried after returning the cache
};

/** Memory statistics of CUDA device `device` (all zero before its first use,
 * and without CUDA). */
MemoryStats cuda_memory_stats(int device = 0);
/** Returns the cached, unused device memory of every device to the driver
 * (for another process, or before measuring). Live tensors keep theirs. */
void cuda_empty_cache();
/** Restarts the peak figures of `device` from the current ones. */
void cuda_reset_peak_memory_stats(int device = 0);

}  // namespace quanta
