// The CPU Adam's threads, started once (DeepSpeed's cpu_adam runs on OpenMP's standing team):
// starting std::threads on every call cost a thread creation per worker per tile per step.
// Torch-free, like the kernels it serves. fork() is safe: it waits for a job in progress, and
// the child's pool starts empty (its threads are started again on first use).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::offload {

class WorkerPool {
 public:
  // The process's pool (created on first use, never destroyed: its threads sleep until called).
  static WorkerPool& shared();

  // Runs fn(0) .. fn(n - 1): fn(0) on the calling thread, the others on the pool's threads (grown
  // to n - 1 as needed); returns when every call has returned, rethrowing the first exception.
  // One job at a time: concurrent callers take turns.
  void run(int n, const std::function<void(int)>& fn);

  ~WorkerPool();
  int threads() const;

 private:
  WorkerPool() = default;
  void before_fork();
  void after_fork(bool child);
  void work(int index);  // a pool thread: runs task index + 1 of each job that has one

  std::mutex turn_;  // held by the caller for a whole job
  mutable std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;           // of the current job
  uint64_t generation_ = 0;  // one per job
  int running_ = 0;         // the current job's tasks on pool threads not yet returned
  std::exception_ptr failure_;
  bool stop_ = false;
};

}  // namespace strata::offload
