#pragma once
// The plan of a large host<->device copy through pinned staging buffers,
// computed on the host. Plain C++ so the CPU tests check it; runtime.cu runs
// it with cudaMemcpyAsync on the device's stream.
//
// Why stage: cudaMemcpy from pageable (malloc'd) memory is synchronous and
// goes through the driver's own small pinned bounce buffer, one piece after
// another, so the host-side copy and the DMA never overlap. Two pinned
// buffers of our own let the CPU fill (or drain) one while the copy engine
// moves the other. Below the threshold the pipeline has nothing to overlap
// (one or two chunks) and its events cost more than they save, so small
// copies keep the plain cudaMemcpy. Host memory that is already pinned
// (cudaHostAlloc, cudaHostRegister) goes straight to the DMA as before.
//
// The sizes are a first choice (docs/gpu-runs.md says where they stand):
// 4 MiB chunks keep each DMA long against its few microseconds of setup;
// the threshold asks for at least four chunks, so that the pipeline is full
// for most of the copy.
#include <algorithm>
#include <cstddef>
#include <vector>

namespace quanta::cuda {

inline constexpr std::size_t kStagingChunkBytes = std::size_t(4) << 20;
inline constexpr std::size_t kStagingThresholdBytes = std::size_t(16) << 20;
/** The two pinned buffers a staged copy alternates between. */
inline constexpr int kStagingBuffers = 2;

/** One piece of a staged copy: bytes [offset, offset + bytes) of the copy,
 * passing through staging buffer `buffer` (0 or 1). */
struct StagedChunk {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  int buffer = 0;
  bool operator==(const StagedChunk&) const = default;
};

/** Whether a host<->device copy of `nbytes` goes through the staging buffers:
 * only pageable host memory of at least `threshold` bytes. */
inline bool use_staging(std::size_t nbytes, bool host_pinned,
                        std::size_t threshold = kStagingThresholdBytes) {
  return !host_pinned && nbytes > 0 && nbytes >= threshold;
}

/** The chunks of a staged copy of `nbytes`: consecutive, in order, each
 * `chunk` bytes but the last (the rest), alternating between the buffers
 * starting with 0. Empty for 0 bytes. */
inline std::vector<StagedChunk> staging_plan(std::size_t nbytes,
                                             std::size_t chunk = kStagingChunkBytes) {
  std::vector<StagedChunk> plan;
  if (chunk == 0) chunk = 1;
  plan.reserve((nbytes + chunk - 1) / chunk);
  for (std::size_t off = 0, i = 0; off < nbytes; off += chunk, ++i)
    plan.push_back({off, std::min(chunk, nbytes - off), static_cast<int>(i % kStagingBuffers)});
  return plan;
}

}  // namespace quanta::cuda
