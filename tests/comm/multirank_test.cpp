// Collectives over real processes on loopback (Gloo, CPU tensors): 2, 3 and 4 ranks, every
// dtype, uneven all-to-all, async handles, sub-groups, launcher conventions, the errors when a
// rank is missing or dead, calls that differ between the ranks, any dtype and layout, and float16
// averages. Each rank checks its own results (scenarios.cpp, scenarios_calls.cpp); here we check
// that every rank exited 0, and in how long.
#include <gtest/gtest.h>

#include <iostream>

#include "ranks.h"

namespace strata::test {
namespace {

// Starts `world` ranks (or only `ranks`) of a scenario; `timeout` sets STRATA_TIMEOUT.
Launched run(const std::string& scenario, int world, std::vector<int> ranks = {},
             const std::string& convention = "torchrun", const std::string& timeout = "") {
  LaunchSpec spec;
  spec.scenario = scenario;
  spec.world = world;
  spec.ranks = std::move(ranks);
  spec.convention = convention;
  if (!timeout.empty()) spec.env.emplace_back("STRATA_TIMEOUT", timeout);
  Launched r = run_ranks(spec);
  r.print_messages();
  return r;
}

TEST(CommMultirank, CollectivesOnTwoRanks) {
  auto r = run("collectives", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, CollectivesOnThreeRanks) {
  auto r = run("collectives", 3);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, CollectivesOnFourRanks) {
  auto r = run("collectives", 4);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, AsyncHandlesWaitedOutOfOrder) {
  auto r = run("async", 3);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, SubGroupsSplitAndExpertTopology) {
  auto r = run("subgroups", 4);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, OpenMpiEnvironment) {
  auto r = run("env_ompi", 2, {}, "OpenMPI");
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, SlurmEnvironmentWithMasterFromNodeList) {
  auto r = run("env_slurm", 3, {}, "SLURM");
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, AbsentRankTimesOutNamingIt) {
  auto r = run("timeout_absent", 3, {}, "torchrun", std::to_string(kScenarioTimeoutS));
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 15 + kScenarioExtraS + kSanitizedStartupSeconds) << r.report();
}

TEST(CommMultirank, DeadRankIsNamed) {
  auto r = run("timeout_dead", 3, {}, "torchrun", std::to_string(kScenarioTimeoutS));
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 12 + kScenarioExtraS + kSanitizedStartupSeconds) << r.report();
}

TEST(CommMultirank, RankMissingAtRendezvous) {
  auto r = run("rendezvous_absent", 3, {0, 1}, "torchrun", std::to_string(kScenarioTimeoutS));
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 10 + kScenarioExtraS + kSanitizedStartupSeconds) << r.report();
}

TEST(CommMultirank, StoreServerMissingAtRendezvous) {
  auto r = run("rendezvous_no_server", 3, {1, 2}, "torchrun", std::to_string(kScenarioTimeoutS));
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 10 + kScenarioExtraS + kSanitizedStartupSeconds) << r.report();
}

TEST(CommMultirank, RankMissingAtNewGroup) {
  auto r = run("new_group_absent", 3, {}, "torchrun", std::to_string(kScenarioTimeoutS));
  EXPECT_TRUE(r.all_ok()) << r.report();
  EXPECT_LT(r.seconds, 12 + kScenarioExtraS + kSanitizedStartupSeconds) << r.report();
}

// Different sizes, dtypes, roots, splits or collectives on the ranks: an error on every rank at
// once, and the group works on. Before the call check, Gloo aborted the rank that received too
// much (SIGABRT on Gloo's thread) and a broadcast left stale data.
TEST(CommMultirank, MismatchedCallsFailOnEveryRank) {
  auto r = run("mismatch", 2, {}, "torchrun", "5");
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, MismatchedCallsOnThreeRanks) {
  auto r = run("mismatch", 3, {}, "torchrun", "5");
  EXPECT_TRUE(r.all_ok()) << r.report();
}

// bool / int8 / int16 buffers, channels_last parameters and views (a model's start-up broadcast).
TEST(CommMultirank, AnyDtypeAndNonContiguousTensors) {
  auto r = run("any_dtype", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(CommMultirank, HalfAverageDoesNotOverflow) {
  auto r = run("half_average", 2);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace strata::test
