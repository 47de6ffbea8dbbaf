// The multi-process suite on CUDA tensors (NCCL), one GPU per rank. Skips cleanly when this build
// has no NCCL or the machine has fewer GPUs than the ranks a test needs.
#include <gtest/gtest.h>

#include <iostream>

#include "ranks.h"

namespace strata::test {
namespace {

Launched run_on_gpus(const std::string& scenario, int world,
                     std::vector<std::pair<std::string, std::string>> env = {}) {
  LaunchSpec spec;
  spec.scenario = scenario;
  spec.world = world;
  spec.device = "cuda";
  spec.env = std::move(env);
  spec.timeout_s = 90;
  Launched r = run_ranks(spec);
  r.print_messages();
  return r;
}

#define REQUIRE_GPUS(n)                                                                  \
  do {                                                                                   \
    if (!nccl_built()) GTEST_SKIP() << "this build of Strata has no NCCL";               \
    if (cuda_devices() < (n))                                                            \
      GTEST_SKIP() << "needs " << (n) << " GPUs, this machine has " << cuda_devices();   \
  } while (0)

TEST(CommGpu, CollectivesOnTwoRanks) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("collectives", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, CollectivesOnThreeRanks) {
  REQUIRE_GPUS(3);
  auto r = run_on_gpus("collectives", 3);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, CollectivesOnFourRanks) {
  REQUIRE_GPUS(4);
  auto r = run_on_gpus("collectives", 4);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, AsyncHandlesWaitedOutOfOrder) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("async", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, SubGroupsSplitAndExpertTopology) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("subgroups", cuda_devices() >= 4 ? 4 : 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, AbsentRankFailsTheCollectiveThroughTheWatchdog) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("timeout_absent", 2, {{"STRATA_TIMEOUT", "3"}});
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 30) << r.report();
}

TEST(CommGpu, AbsentRankWithBlockingWait) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("timeout_absent", 2,
                       {{"STRATA_TIMEOUT", "3"}, {"STRATA_NCCL_BLOCKING_WAIT", "1"}});
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 30) << r.report();
}

TEST(CommGpu, DeadRankIsNamed) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("timeout_dead", 2, {{"STRATA_TIMEOUT", "3"}});
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 30) << r.report();
}

// With STRATA_COMM_CHECK=all the ranks compare CUDA calls too, over Gloo, before NCCL sees them.
TEST(CommGpu, MismatchedCallsFailOnEveryRankWithCheckAll) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("mismatch", 2, {{"STRATA_COMM_CHECK", "all"}, {"STRATA_TIMEOUT", "5"}});
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, AnyDtypeAndNonContiguousTensors) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("any_dtype", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommGpu, HalfAverageDoesNotOverflow) {
  REQUIRE_GPUS(2);
  auto r = run_on_gpus("half_average", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace strata::test

namespace strata::test {
namespace {

TEST(CommGpu, MixingCpuAndCudaTensorsNamesTheCollective) {
  REQUIRE_GPUS(1);
  auto r = run_on_gpus("mixed_devices", 1);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace strata::test
