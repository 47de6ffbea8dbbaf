#include "launcher/supervisor.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

#include "launcher/line_prefixer.h"

extern char** environ;

namespace strata::launcher {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kRemoteExtra = std::chrono::seconds(3);  // lets a node launcher finish its own grace

struct Child {
  ChildSpec spec;
  pid_t pid = -1;  // also its process group
  bool running = false;
  bool killed = false;     // SIGKILL sent
  int out = -1, err = -1;  // read ends of its stdout and stderr
  int in = -1;             // write end of an ssh child's stdin
  LinePrefixer out_lines{""}, err_lines{""};
};

void write_all(int fd, const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own stdout is gone (EPIPE): keep supervising, drop the text
    done += static_cast<size_t>(n);
  }
}

void say(const std::string& text) { write_all(STDERR_FILENO, "strata-run: " + text + "\n"); }

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// pid <= 0 is a child that never started: kill(-0) or kill(1) must never happen.
bool group_alive(pid_t group) { return group > 0 && (::kill(-group, 0) == 0 || errno == EPERM); }

std::string describe(int status) {
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       ::strsignal(WTERMSIG(status)));
  return fmt::format("exited with code {}", WEXITSTATUS(status));
}

// argv/envp as the char* arrays execve wants, built before fork (no allocation after it).
struct ExecArgs {
  std::vector<std::string> storage_env;
  std::vector<char*> argv, envp;
  ExecArgs(const ChildSpec& spec) {
    for (char** e = environ; *e; ++e) {
      std::string var = *e;
      std::string name = var.substr(0, var.find('='));
      bool replaced = std::any_of(spec.env.begin(), spec.env.end(),
                                  [&](const auto& kv) { return kv.first == name; });
      if (!replaced) storage_env.push_back(var);
    }
    for (const auto& [name, value] : spec.env) storage_env.push_back(name + "=" + value);
    for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const std::string& e : storage_env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
  }
};

class Supervisor {
 public:
  Supervisor(const std::vector<ChildSpec>& specs, const SuperviseOptions& options)
      : options_(options) {
    for (const ChildSpec& spec : specs) {
      children_.push_back(std::make_unique<Child>());
      children_.back()->spec = spec;
      children_.back()->out_lines = LinePrefixer(spec.prefix);
      children_.back()->err_lines = LinePrefixer(spec.prefix);
    }
  }

  int run() {
    // Signals arrive through a signalfd in the poll loop instead of in handlers.
    sigset_t handled;
    sigemptyset(&handled);
    for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&handled, sig);
    ::sigprocmask(SIG_BLOCK, &handled, &old_mask_);
    signal_fd_ = ::signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signal_fd_ < 0) {
      say(fmt::format("cannot watch signals (signalfd: {}); starting nothing",
                      std::strerror(errno)));
      return 1;
    }
    ::signal(SIGPIPE, SIG_IGN);  // a closed stdout of ours must not kill the supervisor
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
    if (options_.watch_stdin) ::fcntl(STDIN_FILENO, F_SETFL, O_NONBLOCK);
    watching_stdin_ = options_.watch_stdin;

    for (auto& child : children_) {
      if (!start(*child)) {
        decide(1);
        stop(SIGTERM);
        break;
      }
    }
    loop();
    for (auto& child : children_) {  // what is still buffered in the pipes
      drain(child->out, child->out_lines, STDOUT_FILENO);
      drain(child->err, child->err_lines, STDERR_FILENO);
      close_fd(child->in);
    }
    ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    return exit_code_;
  }

 private:
  bool start(Child& c) {
    int out[2], err[2], in[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 ||
        (c.spec.remote && ::pipe2(in, O_CLOEXEC) != 0)) {
      say(fmt::format("cannot create pipes for {}: {}", c.spec.name, std::strerror(errno)));
      return false;
    }
    ExecArgs args(c.spec);
    const std::string exec_error = fmt::format("strata-run: cannot execute {}: ", c.spec.path);
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) {
      say(fmt::format("cannot start {}: {}", c.spec.name, std::strerror(errno)));
      return false;
    }
    if (pid == 0) {  // child: only async-signal-safe calls until execve
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);  // the launcher died before prctl took effect
      int stdin_fd = c.spec.remote ? in[0] : ::open("/dev/null", O_RDONLY);
      ::dup2(stdin_fd, STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      ::sigaction(SIGPIPE, &dfl, nullptr);
      ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
      ::execve(c.spec.path.c_str(), args.argv.data(), args.envp.data());
      const char* why = std::strerror(errno);
      (void)!::write(STDERR_FILENO, exec_error.data(), exec_error.size());
      (void)!::write(STDERR_FILENO, why, std::strlen(why));
      (void)!::write(STDERR_FILENO, "\n", 1);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so a killpg right after fork cannot miss the child
    c.pid = pid;
    c.running = true;
    ::close(out[1]);
    ::close(err[1]);
    c.out = out[0];
    c.err = err[0];
    ::fcntl(c.out, F_SETFL, O_NONBLOCK);
    ::fcntl(c.err, F_SETFL, O_NONBLOCK);
    if (c.spec.remote) {
      ::close(in[0]);
      c.in = in[1];
    }
    return true;
  }

  void loop() {
    while (true) {
      reap();
      const bool any_running =
          std::any_of(children_.begin(), children_.end(), [](const auto& c) { return c->running; });
      if (!any_running && !stopping_) stop(SIGTERM);  // leftovers of ranks that all exited 0
      if (!any_running && std::none_of(children_.begin(), children_.end(),
                                       [](const auto& c) { return group_alive(c->pid); }))
        return;
      int timeout_ms = escalate();

      std::vector<pollfd> fds = {{signal_fd_, POLLIN, 0}};
      if (watching_stdin_) fds.push_back({STDIN_FILENO, POLLIN, 0});
      for (auto& c : children_) {
        if (c->out >= 0) fds.push_back({c->out, POLLIN, 0});
        if (c->err >= 0) fds.push_back({c->err, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) return;

      signalfd_siginfo info;
      while (::read(signal_fd_, &info, sizeof info) == static_cast<ssize_t>(sizeof info))
        if (info.ssi_signo != SIGCHLD) on_signal(static_cast<int>(info.ssi_signo));
      if (watching_stdin_) check_stdin();
      for (auto& c : children_) {
        pump(c->out, c->out_lines, STDOUT_FILENO);
        pump(c->err, c->err_lines, STDERR_FILENO);
      }
    }
  }

  // Reaps children and the orphans this subreaper inherits; the first failure decides the code.
  void reap() {
    int status = 0;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      auto it = std::find_if(children_.begin(), children_.end(),
                             [&](const auto& c) { return c->pid == pid; });
      if (it == children_.end()) continue;  // a grandchild
      Child& c = **it;
      c.running = false;
      const int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      if (code != 0 && !stopping_) {
        const char* hint = c.spec.remote && code == 255
                               ? " (ssh's own failure code: is passwordless ssh to it set up?)"
                               : "";
        say(fmt::format("{} {}{}; stopping the other ranks", c.spec.name, describe(status), hint));
        decide(code);
        stop(SIGTERM);
      }
    }
  }

  void on_signal(int sig) {
    if (signalled_) {
      say(fmt::format("second signal ({}): killing every rank now", ::strsignal(sig)));
      for (auto& c : children_) kill_group(*c);
      return;
    }
    signalled_ = true;
    say(fmt::format("got {}; forwarding it to every rank", ::strsignal(sig)));
    decide(128 + sig);
    stop(sig);
  }

  // --watch-stdin: EOF on stdin means the head launcher or the ssh link to it is gone.
  void check_stdin() {
    char buf[256];
    ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) return;
    watching_stdin_ = false;
    if (signalled_) return;  // already stopping on a signal of our own
    say("stdin closed (the head launcher is gone); stopping the ranks");
    on_signal(SIGTERM);
  }

  void decide(int code) {
    if (exit_code_ == 0) exit_code_ = code;
  }

  void stop(int sig) {
    if (!stopping_) {
      stopping_ = true;
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(options_.grace_seconds));
    }
    for (auto& c : children_) {
      if (c->spec.remote) {
        close_fd(c->in);
      } else if (group_alive(c->pid)) {
        ::kill(-c->pid, sig);
      }
    }
  }

  void kill_group(Child& c) {
    c.killed = true;
    if (group_alive(c.pid)) ::kill(-c.pid, SIGKILL);
  }

  // SIGKILL for groups past the grace period; returns how long poll may sleep.
  int escalate() {
    if (!stopping_) return 1000;
    const auto now = Clock::now();
    auto next = now + std::chrono::milliseconds(200);  // groups can empty without a SIGCHLD here
    for (auto& c : children_) {
      if (c->killed || !group_alive(c->pid)) continue;
      const auto due = kill_at_ + (c->spec.remote ? kRemoteExtra : Clock::duration::zero());
      if (now >= due) {
        say(fmt::format("{} still running {:g} s after the stop signal; sending SIGKILL",
                        c->spec.name, options_.grace_seconds));
        kill_group(*c);
      } else {
        next = std::min(next, due);
      }
    }
    return static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1);
  }

  // One read per wake-up keeps a chatty rank from starving the others.
  void pump(int& fd, LinePrefixer& lines, int to) {
    if (fd < 0) return;
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      write_all(to, lines.feed(std::string_view(buf, static_cast<size_t>(n))));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      write_all(to, lines.flush());
      close_fd(fd);
    }
  }

  void drain(int& fd, LinePrefixer& lines, int to) {
    while (fd >= 0) {
      char buf[65536];
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        write_all(to, lines.feed(std::string_view(buf, static_cast<size_t>(n))));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      write_all(to, lines.flush());  // EOF, or a writer that escaped its group still holds it
      close_fd(fd);
    }
  }

  SuperviseOptions options_;
  std::vector<std::unique_ptr<Child>> children_;
  sigset_t old_mask_{};
  int signal_fd_ = -1;
  bool watching_stdin_ = false;
  bool signalled_ = false;
  bool stopping_ = false;
  int exit_code_ = 0;
  Clock::time_point kill_at_;
};

}  // namespace

int supervise(const std::vector<ChildSpec>& children, const SuperviseOptions& options) {
  return Supervisor(children, options).run();
}

}  // namespace strata::launcher
