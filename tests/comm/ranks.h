// Multi-process tests: the test binary starts N copies of itself on loopback, each with one
// rank's environment and STRATA_COMM_SCENARIO=<name>; main() then runs that scenario instead of
// GoogleTest. A scenario asserts on its own rank (a failed check throws) and its process exits
// 0 only when every check held.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../sanitized.h"

namespace strata::test {

// STRATA_TIMEOUT of the timeout scenarios: 3 s; under a sanitizer 8 s, where each rank takes 2-4 s
// to start (LibTorch's initializers through the sanitizer's runtime, 3 ranks on 2 cores) and a
// 3 s rendezvous timed out before the last rank arrived. kScenarioExtraS shifts their bounds.
inline constexpr int kScenarioTimeoutS = kSanitized ? 8 : 3;
inline constexpr int kScenarioExtraS = kScenarioTimeoutS - 3;

struct LaunchSpec {
  std::string scenario;
  int world = 2;
  std::vector<int> ranks;                // ranks to start; empty: all of them
  std::string convention = "torchrun";  // "torchrun", "OpenMPI" or "SLURM"
  std::vector<std::pair<std::string, std::string>> env;  // set on top
  double timeout_s = 40;                 // the whole run; then the ranks are killed
  std::string device = "cpu";            // STRATA_COMM_DEVICE for the scenario
};

struct RankResult {
  int rank = -1;
  int code = -1;  // exit code; 128+signal if killed by one; -1 if it outlived timeout_s
  std::string output;  // stdout and stderr
};

struct Launched {
  std::vector<RankResult> ranks;
  double seconds = 0;
  bool all_ok() const;
  std::string report() const;  // every rank's exit code and output, for failure messages
  void print_messages() const;  // each rank's gtest "MESSAGE: " lines, prefixed with its rank
};

Launched run_ranks(const LaunchSpec& spec);

int free_port();

// Scenarios: registered by name, run in the child process.
using Scenario = std::function<void()>;
bool register_scenario(const std::string& name, Scenario fn);
// main(): runs the scenario named by STRATA_COMM_SCENARIO when set, else GoogleTest.
int test_main(int argc, char** argv);

}  // namespace strata::test

#define STRATA_SCENARIO(name)                                                          \
  static void scenario_##name();                                                       \
  static const bool scenario_registered_##name =                                        \
      ::strata::test::register_scenario(#name, scenario_##name);                        \
  static void scenario_##name()

namespace strata::test {
int cuda_devices();  // torch::cuda::device_count()
bool nccl_built();   // strata::comm::nccl_available()
}  // namespace strata::test
