#include "engine/serial_worker.h"

#include <utility>

namespace quanta::detail {

SerialWorker::SerialWorker() : thread_([this] { serve(); }) {}

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  posted_.notify_all();
  thread_.join();
}

void SerialWorker::post(std::function<void()> job, bool after_failure) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back({std::move(job), after_failure});
    ++posted_count_;
  }
  posted_.notify_all();
}

void SerialWorker::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = posted_count_;
  finished_.wait(lock, [&] { return finished_count_ >= target; });
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

uint64_t SerialWorker::posted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return posted_count_;
}

void SerialWorker::wait_for(uint64_t mark) {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [&] { return finished_count_ >= mark; });
}

void SerialWorker::serve() {
  for (;;) {
    // Everything posted so far in one take: one lock and one wake-up for a
    // run of small jobs (a GPU stream's kernels come in runs).
    std::deque<Job> batch;
    bool failed = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      posted_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      batch.swap(jobs_);
      failed = failure_ != nullptr;
    }
    for (Job& job : batch) {
      if (!failed || job.after_failure) {
        try {
          job.run();
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!failure_) failure_ = std::current_exception();
          failed = true;
        }
      }
      job.run = nullptr;  // its captures go before a wait for it returns
      // Counted one by one: a wait for a mark (wait_for) must not wait for
      // the jobs after it, which may take long or wait themselves.
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++finished_count_;
      }
      finished_.notify_all();
    }
  }
}

}  // namespace quanta::detail
