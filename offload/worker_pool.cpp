#include "offload/worker_pool.h"

#include <pthread.h>

#include <new>

namespace strata::offload {

WorkerPool& WorkerPool::shared() {
  static WorkerPool* pool = [] {
    auto* p = new WorkerPool;  // leaked on purpose: no teardown order at exit
    // fork(): no job may be half-way (the handlers hold both locks across it), and the child,
    // which has none of the parent's threads, starts with an empty pool.
    pthread_atfork([] { shared().before_fork(); }, [] { shared().after_fork(false); },
                   [] { shared().after_fork(true); });
    return p;
  }();
  return *pool;
}

void WorkerPool::before_fork() {
  turn_.lock();
  mutex_.lock();
}

void WorkerPool::after_fork(bool child) {
  if (child) {
    // The handles of threads that do not exist here: kept, never joined or destroyed.
    new std::vector<std::thread>(std::move(threads_));
    threads_.clear();
    // The parent's idle threads were waiting on start_cv_: a condition variable copied with
    // waiters that do not exist here can lose the child's wake-ups (a hang, about 1 run in 150
    // under load). Fresh ones, the old ones' bytes left as they are (destroying a condition
    // variable with waiters is undefined).
    new (&start_cv_) std::condition_variable;
    new (&done_cv_) std::condition_variable;
    generation_ = 0;
    running_ = 0;
    fn_ = nullptr;
  }
  mutex_.unlock();
  turn_.unlock();
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

int WorkerPool::threads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return int(threads_.size());
}

void WorkerPool::run(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  std::lock_guard<std::mutex> turn(turn_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (int(threads_.size()) < n - 1) {
      const int index = int(threads_.size());
      threads_.emplace_back([this, index] { work(index); });
    }
    fn_ = &fn;
    tasks_ = n;
    running_ = n - 1;
    failure_ = nullptr;
    ++generation_;
  }
  start_cv_.notify_all();
  std::exception_ptr mine;
  try {
    fn(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return running_ == 0; });
  fn_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (failure_) std::rethrow_exception(failure_);
}

void WorkerPool::work(int index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  seen = generation_;  // a thread grown for a job joins that job
  if (seen > 0) --seen;
  for (;;) {
    start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index + 1 >= tasks_) continue;  // this job needs fewer threads
    const auto* fn = fn_;
    lock.unlock();
    std::exception_ptr failure;
    try {
      (*fn)(index + 1);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (failure && !failure_) failure_ = failure;
    if (--running_ == 0) done_cv_.notify_one();
  }
}

}  // namespace strata::offload
