// Runs the real strata-run binary for the launcher tests: output captured with stdout and stderr
// apart, a timeout, signals to send mid-run, and a /proc scan for processes left behind.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace strata::test {

struct Finished {
  int code = -1;  // exit code, 128+signal if killed, -1 if it timed out (then it was SIGKILLed)
  std::string out, err;
  double seconds = 0;
};

// NAME -> value to set, or nullopt to unset, over the test's own environment.
using EnvChanges = std::vector<std::pair<std::string, std::optional<std::string>>>;

std::string launcher_path();  // STRATA_BIN_DIR/strata-run, symlinks resolved

// The working folder as the launcher names it to remote hosts: $PWD when it is this folder.
std::string typed_cwd();

// How the launcher starts, where a test needs more than its arguments and environment.
struct LaunchSetup {
  int max_open_files = 0;       // > 0: its RLIMIT_NOFILE soft limit (descriptor numbers below it)
  bool ignore_sigterm = false;  // SIG_IGN, which its ranks inherit through execve
  bool stdin_pipe = false;      // its stdin a pipe from the test (write_stdin, close_stdin)
  std::string directory;        // non-empty: run it there, with PWD set to this path as given
  std::string launcher;         // non-empty: the strata-run to execute (argv[0]), as given
};

class LauncherProcess {
 public:
  explicit LauncherProcess(const std::vector<std::string>& args, const EnvChanges& env = {},
                           const LaunchSetup& setup = {});
  ~LauncherProcess();  // SIGKILLs a launcher still running
  LauncherProcess(const LauncherProcess&) = delete;
  LauncherProcess& operator=(const LauncherProcess&) = delete;

  // Reads output until stdout holds `text` `count` times; false on timeout or exit.
  bool wait_for_stdout(const std::string& text, int count, double timeout_s);
  bool wait_for_stderr(const std::string& text, int count, double timeout_s);  // the same
  void signal(int sig);
  void write_stdin(const std::string& text);
  void close_stdin();
  Finished wait(double timeout_s);
  pid_t pid() const { return pid_; }
  const std::string& out() const { return result_.out; }  // stdout read so far

 private:
  bool read_some(int timeout_ms);  // false once both pipes are closed
  bool wait_for(const std::string& output, const std::string& text, int count, double timeout_s);

  pid_t pid_ = -1;
  int out_ = -1, err_ = -1, in_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  Finished result_;
  double started_ = 0;
};

Finished run_launcher(const std::vector<std::string>& args, const EnvChanges& env = {},
                      double timeout_s = 20);

// Live processes (not zombies) whose command line contains `marker`, this test excluded.
int count_processes(const std::string& marker);
// Polls count_processes until it reaches `expected` or the timeout passes; returns the last count.
int wait_for_count(const std::string& marker, int expected, double timeout_s);

// The descriptors a child of this test inherits (those without FD_CLOEXEC), e.g. ones its own
// runner leaked to it; a rank sees them too unless the launcher closes them.
std::vector<int> inherited_fds();

// A TCP port that nothing listened on a moment ago.
int free_port();

// A file's whole text ("" when it cannot be read).
std::string read_file(const std::string& path);
// The "loss" of each line of a train_gpt --metrics-jsonl file, as written (compared as text: a
// run that must equal another bit for bit).
std::vector<std::string> metrics_losses(const std::string& path);

// A sleep argument unique to this test process and `which` (0-99), e.g. "600.070041237" for 7 in
// PID 41237 (sleep takes decimals), so a leftover can be found by its command line. Fixed width:
// count_processes matches substrings, and "600.<pid><which>" of one test could be the start of
// another's running at the same time (PID 1234 with 11 and PID 12341 with 1 gave the same).
std::string unique_sleep(int which);

}  // namespace strata::test
