#include "ranks.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "runtime/util/free_port.h"

extern char** environ;

namespace strata::test {
namespace {

std::map<std::string, Scenario>& registry() {
  static std::map<std::string, Scenario> r;
  return r;
}

bool launcher_variable(const std::string& name) {
  static const char* exact[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "STRATA_TIMEOUT",
                                "STRATA_COMM_SCENARIO", "STRATA_COMM_DEVICE",
                                "STRATA_NCCL_BLOCKING_WAIT", "STRATA_COMM_CHECK", "GROUP_RANK",
                                "NODE_RANK"};
  for (const char* e : exact)
    if (name == e) return true;
  return name.rfind("OMPI_", 0) == 0 || name.rfind("SLURM_", 0) == 0;
}

std::vector<std::pair<std::string, std::string>> rank_env(const LaunchSpec& s, int rank,
                                                          int port) {
  const std::string r = std::to_string(rank), w = std::to_string(s.world);
  std::vector<std::pair<std::string, std::string>> env;
  if (s.convention == "OpenMPI") {
    env = {{"OMPI_COMM_WORLD_RANK", r}, {"OMPI_COMM_WORLD_SIZE", w},
           {"OMPI_COMM_WORLD_LOCAL_RANK", r}, {"OMPI_COMM_WORLD_LOCAL_SIZE", w},
           {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
  } else if (s.convention == "SLURM") {
    env = {{"SLURM_PROCID", r}, {"SLURM_NTASKS", w}, {"SLURM_LOCALID", r},
           {"SLURM_TASKS_PER_NODE", w}, {"SLURM_NODEID", "0"},
           {"SLURM_JOB_NODELIST", "localhost"}, {"MASTER_PORT", std::to_string(port)}};
  } else {
    env = {{"RANK", r}, {"WORLD_SIZE", w}, {"LOCAL_RANK", r}, {"LOCAL_WORLD_SIZE", w},
           {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
  }
  env.emplace_back("STRATA_COMM_SCENARIO", s.scenario);
  env.emplace_back("STRATA_COMM_DEVICE", s.device);
  for (auto& kv : s.env) env.push_back(kv);
  return env;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int free_port() {
  // Outside the ephemeral range: see runtime/util/free_port.h for the race a bind(0) port has.
  return pick_free_port();
}

bool Launched::all_ok() const {
  for (auto& r : ranks)
    if (r.code != 0) return false;
  return !ranks.empty();
}

void Launched::print_messages() const {
  for (const auto& rank : ranks) {
    size_t at = 0;
    while ((at = rank.output.find("MESSAGE: ", at)) != std::string::npos) {
      const size_t end = rank.output.find('\n', at);
      std::cout << "[rank " << rank.rank << "] " << rank.output.substr(at + 9, end - at - 9)
                << "\n";
      at = end;
    }
  }
}

std::string Launched::report() const {
  std::string text;
  for (auto& r : ranks)
    text += "--- rank " + std::to_string(r.rank) + " exit " + std::to_string(r.code) + "\n" +
            r.output;
  return text;
}

Launched run_ranks(const LaunchSpec& spec) {
  std::vector<int> ranks = spec.ranks;
  if (ranks.empty())
    for (int r = 0; r < spec.world; ++r) ranks.push_back(r);
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  struct Child {
    int rank;
    pid_t pid;
    std::string log;
    bool done = false;
    int code = -1;
  };
  std::vector<Child> children;
  for (int rank : ranks) {
    char path[] = "/tmp/strata-comm-test-XXXXXX";
    int fd = mkstemp(path);
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (!launcher_variable(kv.substr(0, kv.find('=')))) env.push_back(kv);
    }
    for (auto& [k, v] : rank_env(spec, rank, port)) env.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    char exe[] = "/proc/self/exe";
    char* argv[] = {exe, nullptr};
    pid_t pid = fork();
    if (pid == 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      execve("/proc/self/exe", argv, envp.data());
      _exit(127);
    }
    close(fd);
    children.push_back({rank, pid, path});
  }
  const auto deadline = start + std::chrono::duration<double>(spec.timeout_s);
  size_t left = children.size();
  while (left > 0) {
    for (auto& c : children) {
      if (c.done) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.done = true;
        --left;
        c.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (auto& c : children)
        if (!c.done) {
          kill(c.pid, SIGKILL);
          waitpid(c.pid, nullptr, 0);
          c.done = true;
          c.code = -1;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  Launched out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (auto& c : children) {
    out.ranks.push_back({c.rank, c.code, read_file(c.log)});
    std::remove(c.log.c_str());
  }
  return out;
}

bool register_scenario(const std::string& name, Scenario fn) {
  registry()[name] = std::move(fn);
  return true;
}

int test_main(int argc, char** argv) {
  if (const char* name = std::getenv("STRATA_COMM_SCENARIO")) {
    auto it = registry().find(name);
    const char* rank = std::getenv("RANK");
    if (!rank) rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!rank) rank = std::getenv("SLURM_PROCID");
    const std::string who = std::string("rank ") + (rank ? rank : "?");
    if (it == registry().end()) {
      std::cerr << who << ": no scenario named " << name << std::endl;
      return 2;
    }
    try {
      it->second();
    } catch (const std::exception& e) {
      std::cerr << who << ": FAILED: " << e.what() << std::endl;
      return 1;
    }
    std::cout << who << ": ok" << std::endl;
    return 0;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace strata::test
