#pragma once
// A thread of its own that runs posted jobs one at a time, in the order they
// were posted, while the poster goes on: sim's streams (engine/sim/) and
// DataParallel's communication thread (dist/data_parallel.cpp) are each one.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace quanta::detail {

class SerialWorker {
 public:
  SerialWorker();
  /** Runs what is still posted, then ends the thread. */
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  /** Queues `job` after every job posted before it. The first exception a
   * job throws is kept for drain(); until then later jobs are skipped, but
   * those posted with `after_failure` (what must happen whatever failed,
   * such as freeing memory). */
  void post(std::function<void()> job, bool after_failure = false);

  /** Waits until every job posted so far has run (or been skipped), then
   * rethrows the kept exception, if any, and forgets it. */
  void drain();

  /** How many jobs have been posted: a mark in the queue, as a GPU's event
   * recorded on a stream is. */
  uint64_t posted() const;
  /** Waits until the first `mark` jobs have run (or been skipped); a kept
   * exception stays for drain(). */
  void wait_for(uint64_t mark);
  /** True on the worker's own thread (a job that posts more work must not
   * wait for the queue it is part of). */
  bool on_worker_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  struct Job {
    std::function<void()> run;
    bool after_failure = false;
  };
  void serve();

  mutable std::mutex mutex_;
  std::condition_variable posted_, finished_;
  std::deque<Job> jobs_;
  uint64_t posted_count_ = 0, finished_count_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace quanta::detail
