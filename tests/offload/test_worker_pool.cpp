#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "offload/worker_pool.h"

namespace strata::offload {
namespace {

TEST(WorkerPool, EveryTaskRunsOnceAndTheFirstOnTheCaller) {
  auto& pool = WorkerPool::shared();
  for (int n : {0, 1, 2, 7, 3, 16, 1, 5}) {
    std::vector<std::atomic<int>> runs(size_t(std::max(n, 1)));
    std::thread::id first;
    pool.run(n, [&](int k) {
      runs[size_t(k)]++;
      if (k == 0) first = std::this_thread::get_id();
    });
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(runs[size_t(k)].load(), 1) << "task " << k << " of " << n;
    }
    if (n > 0) {
      EXPECT_EQ(first, std::this_thread::get_id());
    }
  }
  EXPECT_GE(pool.threads(), 15);  // grown to the largest job, and kept
}

TEST(WorkerPool, TasksRunSideBySide) {
  // Four tasks that each wait for all four to have started: done only if they run at once.
  std::atomic<int> started{0};
  WorkerPool::shared().run(4, [&](int) {
    ++started;
    while (started.load() < 4) std::this_thread::yield();
  });
  EXPECT_EQ(started.load(), 4);
}

TEST(WorkerPool, ConcurrentCallersTakeTurnsAndEachGetsItsOwnTasks) {
  std::atomic<int64_t> sums[3] = {{0}, {0}, {0}};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&, c] {
      for (int round = 0; round < 200; ++round)
        WorkerPool::shared().run(2 + c, [&](int k) { sums[c] += k + 1; });
    });
  for (auto& t : callers) t.join();
  for (int c = 0; c < 3; ++c) {
    const int n = 2 + c;
    EXPECT_EQ(sums[c].load(), 200 * n * (n + 1) / 2) << "caller " << c;
  }
}

TEST(WorkerPool, AFailureInAnyTaskReachesTheCallerAndThePoolGoesOn) {
  auto& pool = WorkerPool::shared();
  for (int failing : {0, 2}) {
    std::atomic<int> ran{0};
    EXPECT_THROW(pool.run(3, [&](int k) {
                   ++ran;
                   if (k == failing) throw std::runtime_error("task failed");
                 }),
                 std::runtime_error);
    EXPECT_EQ(ran.load(), 3);  // the others still ran to the end before the caller returned
  }
  std::atomic<int> ran{0};
  pool.run(3, [&](int) { ++ran; });
  EXPECT_EQ(ran.load(), 3);
}

TEST(WorkerPool, AForkedChildRunsJobsOnThreadsOfItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer does not start threads in the child of a threaded fork";
#endif
  auto& pool = WorkerPool::shared();
  pool.run(4, [](int) {});  // the parent's threads exist
  const pid_t pid = fork();
  if (pid == 0) {
    std::atomic<int> ran{0};
    WorkerPool::shared().run(4, [&](int) { ++ran; });
    _exit(ran.load() == 4 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's job did not finish";
  std::atomic<int> ran{0};
  pool.run(4, [&](int) { ++ran; });  // and the parent's pool goes on
  EXPECT_EQ(ran.load(), 4);
}

}  // namespace
}  // namespace strata::offload
