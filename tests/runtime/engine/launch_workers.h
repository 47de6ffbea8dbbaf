// Multi-rank engine tests: the driver test re-runs this very binary as N ranks through
// strata-run, with `marker`=1 in their environment and a gtest filter naming the worker tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace strata::test_support {

inline bool is_worker(const char* marker) { return std::getenv(marker) != nullptr; }

inline int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

// Runs the ranks; their combined output goes to `output`; returns strata-run's exit code.
inline int launch_workers(const char* marker, int ranks, const std::string& filter,
                          std::string* output) {
  const std::string command = std::string(marker) + "=1 STRATA_TIMEOUT=60 " + STRATA_BIN_DIR +
                              "/strata-run --nproc-per-node " + std::to_string(ranks) +
                              " -- /proc/" + std::to_string(getpid()) + "/exe --gtest_filter='" +
                              filter + "' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace strata::test_support
