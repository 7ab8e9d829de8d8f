#pragma once
// Where an asynchronous upload's bytes wait in pinned memory, decided on the
// host. Plain C++ so the CPU tests check it; runtime.cu runs it with
// cudaMemcpyAsync and one event per upload.
//
// Why: cudaMemcpy from pageable memory first waits for the stream to drain,
// so every small upload (a batch, a scalar, drawn positions) would be a host
// sync in the middle of a step. Copied into a ring of pinned memory instead,
// the upload is queued on the device's stream, in order with the kernels,
// and the host goes on at once (its source is free to reuse). The host
// waits only when the ring comes round to bytes whose DMA is still queued.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>

namespace quanta::cuda {

/** Uploads up to this size go through the ring; larger ones are copied
 * synchronously (staging.h), where the wait costs little against the copy. */
inline constexpr std::size_t kAsyncUploadMaxBytes = std::size_t(4) << 20;
/** The ring's pinned bytes per device (made at its first upload). */
inline constexpr std::size_t kUploadRingBytes = std::size_t(32) << 20;
/** Every upload starts on this boundary (DMA-friendly; the ring holds at
 * most capacity / alignment uploads at once). */
inline constexpr std::size_t kUploadAlignment = 256;

/** One upload's place in the ring: bytes [offset, offset + bytes) carry it
 * (bytes rounded up to the alignment); before writing them the host waits
 * for upload `wait_for` (0: none), the newest earlier upload whose bytes
 * overlap, and with it, in stream order, every older one. `seq` numbers the
 * uploads from 1. */
struct UploadSpan {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  uint64_t seq = 0;
  uint64_t wait_for = 0;
  bool operator==(const UploadSpan&) const = default;
};

class UploadRing {
 public:
  explicit UploadRing(std::size_t capacity = kUploadRingBytes,
                      std::size_t alignment = kUploadAlignment)
      : capacity_(capacity), alignment_(alignment == 0 ? 1 : alignment) {}

  /** The next upload of `nbytes` (1 <= nbytes <= capacity): after the last
   * one, or from the start when it does not fit before the end. */
  UploadSpan reserve(std::size_t nbytes) {
    const std::size_t size = (nbytes + alignment_ - 1) / alignment_ * alignment_;
    if (nbytes == 0 || size > capacity_)
      throw std::invalid_argument("[UploadRing] an upload of " + std::to_string(nbytes) +
                                  " bytes does not fit a ring of " + std::to_string(capacity_));
    if (head_ + size > capacity_) head_ = 0;
    UploadSpan span{head_, size, ++seq_, 0};
    // The newest queued upload overlapping the span: it and everything
    // older leave the queue (they are done once it is).
    std::size_t drop = 0;
    for (std::size_t i = 0; i < queued_.size(); ++i)
      if (queued_[i].offset < head_ + size && head_ < queued_[i].offset + queued_[i].bytes) {
        span.wait_for = queued_[i].seq;
        drop = i + 1;
      }
    queued_.erase(queued_.begin(), queued_.begin() + static_cast<std::ptrdiff_t>(drop));
    queued_.push_back(span);
    head_ += size;
    return span;
  }

 private:
  std::size_t capacity_, alignment_;
  std::size_t head_ = 0;
  uint64_t seq_ = 0;
  std::deque<UploadSpan> queued_;  // in upload order
};

}  // namespace quanta::cuda
