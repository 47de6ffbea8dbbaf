// Runs checkpoint_tool as a child process: killed with SIGKILL at a random moment, or to its end.
#pragma once

#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace strata::test {

inline std::string checkpoint_tool() { return std::string(STRATA_BIN_DIR) + "/checkpoint_tool"; }

// Starts `checkpoint_tool args...` with its stdout into `out[1]` (closed here); returns its pid.
inline pid_t spawn_checkpoint_tool(const std::vector<std::string>& args, int out[2]) {
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    std::vector<char*> argv;
    const std::string tool = checkpoint_tool();
    argv.push_back(const_cast<char*>(tool.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(tool.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  return pid;
}

// Runs `checkpoint_tool args...` to its end: its exit code, or 128 + the signal that ended it.
inline int run_checkpoint_tool(const std::vector<std::string>& args) {
  int out[2];
  if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = spawn_checkpoint_tool(args, out);
  char c;
  while (::read(out[0], &c, 1) == 1) {
  }
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class KilledChild {
 public:
  // Starts `checkpoint_tool args...` and waits until it prints its first line ("started").
  explicit KilledChild(const std::vector<std::string>& args) {
    int out[2];
    if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
    pid_ = spawn_checkpoint_tool(args, out);
    char c;
    while (::read(out[0], &c, 1) == 1 && c != '\n') started_.push_back(c);
    ::close(out[0]);
  }
  ~KilledChild() { kill_now(); }

  bool started() const { return started_ == "started"; }

  // SIGKILL, reaped. Returns true when the child was still running (the kill interrupted it).
  bool kill_now() {
    if (pid_ <= 0) return false;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  }

 private:
  pid_t pid_ = -1;
  std::string started_;
};

}  // namespace strata::test
