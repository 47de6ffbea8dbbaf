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
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "launcher/line_prefixer.h"
#include "launcher/process_table.h"

extern char** environ;

namespace strata::launcher {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kRemoteExtra = std::chrono::seconds(3);  // lets a node launcher finish its own grace
constexpr auto kSweepEvery = std::chrono::milliseconds(200);  // groups can empty without a SIGCHLD

struct Child {
  ChildSpec spec;
  pid_t pid = -1;        // also its process group
  bool running = false;  // has not exited
  // Reaped only once it has exited and its group has no live member: until then the zombie holds
  // the number, so killpg(pid) cannot reach a process that was given it after us.
  bool reaped = false;
  bool killed = false;     // SIGKILL sent
  int out = -1, err = -1;  // read ends of its stdout and stderr
  int in = -1;             // write end of an ssh child's stdin
  LinePrefixer out_lines{""}, err_lines{""};
  std::string ssh_said;  // an ssh child's recent lines of its own (ssh's, the remote shell's)
  // An ssh child told "kill": ssh itself is killed if it has not ended by then.
  std::optional<Clock::time_point> ssh_kill_at;

  // pid <= 0 is a child that never started: kill(-0) or kill(1) must never happen.
  bool may_signal() const { return pid > 0 && !reaped; }
};

// A descriptor closed when it goes out of scope unless released, so no error path leaks one.
class Fd {
 public:
  Fd() = default;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read, write;
  bool open() {  // close-on-exec: a child keeps only the copies dup2 puts on 0-2
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return false;
    read.reset(fds[0]);
    write.reset(fds[1]);
    return true;
  }
};

void write_all(int fd, const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own stdout is gone (EPIPE): keep supervising, drop the text
    done += static_cast<size_t>(n);
  }
}


void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

bool was_killed(const siginfo_t& exit) {
  return exit.si_code == CLD_KILLED || exit.si_code == CLD_DUMPED;
}

std::string describe(const siginfo_t& exit) {
  if (was_killed(exit))
    return fmt::format("was killed by signal {} ({})", exit.si_status, ::strsignal(exit.si_status));
  return fmt::format("exited with code {}", exit.si_status);
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
      if (spec.remote) {  // the node launcher prefixes its own lines
        const std::vector<std::string> own = {"[rank ", "strata-run"};
        children_.back()->out_lines = LinePrefixer("[ssh " + spec.host + "] ", own);
        children_.back()->err_lines = LinePrefixer("[ssh " + spec.host + "] ", own);
      } else {
        children_.back()->out_lines = LinePrefixer(spec.prefix);
        children_.back()->err_lines = LinePrefixer(spec.prefix);
      }
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
      drain(*child, child->out, child->out_lines, STDOUT_FILENO);
      drain(*child, child->err, child->err_lines, STDERR_FILENO);
      close_fd(child->in);
    }
    ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    return exit_code_;
  }

 private:
  bool start(Child& c) {
    Pipe out, err, in;
    if (!out.open() || !err.open() || (c.spec.remote && !in.open())) {
      say(fmt::format("cannot create pipes for {}: {}", c.spec.name, std::strerror(errno)));
      return false;
    }
    if (c.spec.remote && !c.spec.stdin_text.empty()) {
      const size_t size = c.spec.stdin_text.size();
      if (size > 60000) ::fcntl(in.write.get(), F_SETPIPE_SZ, static_cast<int>(size + 4096));
      const ssize_t n = ::write(in.write.get(), c.spec.stdin_text.data(), size);
      if (n != static_cast<ssize_t>(size)) {
        say(fmt::format("cannot pass {} bytes of variables to {} on its stdin: {}", size,
                        c.spec.name, n < 0 ? std::strerror(errno) : "the pipe is too small"));
        return false;
      }
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
      // Close-on-exec like the pipes: execve keeps only the copy on 0.
      int stdin_fd = c.spec.remote ? in.read.get() : ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      ::dup2(stdin_fd, STDIN_FILENO);
      ::dup2(out.write.get(), STDOUT_FILENO);
      ::dup2(err.write.get(), STDERR_FILENO);
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
    c.out = out.read.release();
    c.err = err.read.release();
    c.in = in.write.release();  // -1 unless remote
    if (c.in >= 0) ::fcntl(c.in, F_SETFL, O_NONBLOCK);  // a stuck ssh cannot block a stop line
    ::fcntl(c.out, F_SETFL, O_NONBLOCK);
    ::fcntl(c.err, F_SETFL, O_NONBLOCK);
    return true;  // the child's ends close here
  }

  void say(const std::string& text) const {
    const std::string who =
        options_.label.empty() ? "strata-run" : "strata-run (" + options_.label + ")";
    write_all(STDERR_FILENO, who + ": " + text + "\n");
  }

  void loop() {
    while (true) {
      note_exits();
      const bool any_running =
          std::any_of(children_.begin(), children_.end(), [](const auto& c) { return c->running; });
      if (!any_running && !stopping_) stop(SIGTERM);  // leftovers of ranks that all exited 0
      if (sweep_due_ || (stopping_ && Clock::now() >= next_sweep_)) sweep();
      if (!any_running && std::none_of(children_.begin(), children_.end(),
                                       [](const auto& c) { return c->may_signal(); }))
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
      while (::read(signal_fd_, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
        if (info.ssi_signo == SIGCHLD)
          sweep_due_ = true;
        else
          on_signal(static_cast<int>(info.ssi_signo));
      }
      if (watching_stdin_) check_stdin();
      for (auto& c : children_) {
        pump(*c, c->out, c->out_lines, STDOUT_FILENO);
        pump(*c, c->err, c->err_lines, STDERR_FILENO);
      }
    }
  }

  // Notes the children that exited, without reaping them (WNOWAIT, see Child::reaped); the
  // first failure decides the code.
  void note_exits() {
    for (auto& c : children_) {
      siginfo_t exit{};
      if (!c->running ||
          ::waitid(P_PID, static_cast<id_t>(c->pid), &exit, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          exit.si_pid != c->pid)
        continue;
      c->running = false;
      const int code = was_killed(exit) ? 128 + exit.si_status : exit.si_status;
      if (code != 0 && !stopping_) {
        const std::string why = c->spec.remote ? ssh_failure(*c, code) : "";
        say(fmt::format("{} {}; stopping the other ranks", c->spec.name,
                        why.empty() ? describe(exit) : describe(exit) + ": " + why));
        decide(code);
        stop(SIGTERM);
      }
    }
  }

  // An ssh child's failure in words, from its code and what ssh or the remote shell said; "" when
  // neither tells (a rank's own code comes through the node launcher).
  static std::string ssh_failure(const Child& c, int code) {
    auto said = [&](const char* text) { return c.ssh_said.find(text) != std::string::npos; };
    const std::string& host = c.spec.host;
    if (code == 127 && !c.spec.remote_launcher.empty() && said(c.spec.remote_launcher.c_str()))
      return fmt::format(
          "the shell on {} cannot run {}; strata-run must be at that path on every host (the "
          "path this one was started by), or STRATA_REMOTE_LAUNCHER names where it is there",
          host, c.spec.remote_launcher);
    if (code != 255) return "";
    if (said("timed out") || said("Timeout, server"))
      return fmt::format(
          "ssh to {} did not connect within {} s (the host is down or unreachable, or its sshd "
          "does not answer; --ssh-connect-timeout sets the limit)",
          host, c.spec.connect_timeout);
    if (said("Connection refused"))
      return fmt::format(
          "ssh to {} was refused: nothing listens on its ssh port (is sshd running there? "
          "--ssh-port or the ssh config's Port choose the port)",
          host);
    if (said("Could not resolve hostname"))
      return fmt::format(
          "ssh cannot resolve '{}' (neither a host name nor a Host of the ssh config)", host);
    if (said("Host key verification failed"))
      return fmt::format("ssh does not know {}'s host key, or it changed (connect once by hand)",
                         host);
    if (said("Permission denied") || said("Too many authentication failures"))
      return fmt::format(
          "ssh to {} could not log in: is passwordless (key) ssh to it set up for this user?",
          host);
    if (said("closed by") || said("reset by") || said("Broken pipe") || said("Connection closed"))
      return fmt::format("the ssh connection to {} was dropped", host);
    return "ssh's own failure code, or a rank's";
  }

  // Reaps the orphans this subreaper inherited (one by one: waitpid(-1) would reap the children
  // kept as zombies) and, once stopping, each exited child whose group has no live member left.
  void sweep() {
    sweep_due_ = false;
    next_sweep_ = Clock::now() + kSweepEvery;
    const std::vector<ProcessInfo> table = list_processes();
    const pid_t self = ::getpid();
    for (const ProcessInfo& p : table) {
      const bool kept = std::any_of(children_.begin(), children_.end(),
                                    [&](const auto& c) { return c->pid == p.pid && !c->reaped; });
      if (p.ppid == self && p.dead() && !kept) ::waitpid(p.pid, nullptr, WNOHANG);
    }
    if (!stopping_) return;  // a group is signalled again when the job stops
    for (auto& c : children_) {
      if (c->running || !c->may_signal() ||
          std::any_of(table.begin(), table.end(),
                      [&](const ProcessInfo& p) { return p.pgrp == c->pid && !p.dead(); }))
        continue;
      // The table is no snapshot: a member forked while it was read can be missing from it. The
      // number is still ours, so this reaches only such a member.
      ::kill(-c->pid, SIGKILL);
      c->reaped = ::waitpid(c->pid, nullptr, WNOHANG) == c->pid;
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

  // --watch-stdin: the head's "stop N" and "kill" lines; EOF without them means the head
  // launcher or the ssh link to it is gone. The head reports the stop, so this says nothing.
  void check_stdin() {
    char buf[256];
    ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n > 0) {
      stdin_text_.append(buf, static_cast<size_t>(n));
      for (size_t end; (end = stdin_text_.find('\n')) != std::string::npos;) {
        const std::string line = stdin_text_.substr(0, end);
        stdin_text_.erase(0, end + 1);
        if (line == "kill") {
          for (auto& c : children_) kill_group(*c);
        } else if (line.rfind("stop ", 0) == 0 && !signalled_) {
          const int sig = std::atoi(line.c_str() + 5);
          signalled_ = true;  // a signal of our own now kills at once, as the head's second would
          decide(128 + (sig > 0 ? sig : SIGTERM));
          stop(sig > 0 ? sig : SIGTERM);
        }
      }
      return;
    }
    watching_stdin_ = false;
    if (signalled_) return;  // already stopping
    say("stdin closed without a stop from the head launcher (it or the ssh link is gone); "
        "stopping the ranks");
    signalled_ = true;
    decide(128 + SIGTERM);
    stop(SIGTERM);
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
        if (c->in >= 0) write_all(c->in, fmt::format("stop {}\n", sig));
      } else if (c->may_signal()) {
        ::kill(-c->pid, sig);
      }
    }
  }

  void kill_group(Child& c) {
    if (c.spec.remote && c.in >= 0 && c.running) {  // its node launcher kills the ranks at once
      write_all(c.in, "kill\n");
      close_fd(c.in);
      c.ssh_kill_at = Clock::now() + kRemoteExtra;
      return;
    }
    c.killed = true;
    if (c.may_signal()) ::kill(-c.pid, SIGKILL);
  }

  // SIGKILL for groups past the grace period; returns how long poll may sleep.
  int escalate() {
    if (!stopping_) return 1000;
    const auto now = Clock::now();
    auto next = now + kSweepEvery;  // the next sweep
    for (auto& c : children_) {
      if (c->killed || !c->may_signal()) continue;
      const auto due = c->ssh_kill_at
                           ? *c->ssh_kill_at
                           : kill_at_ + (c->spec.remote ? kRemoteExtra : Clock::duration::zero());
      if (now >= due && c->spec.remote) {
        say(fmt::format("{}: ssh has not ended 3 s after its node launcher was to kill the ranks "
                        "there ({:g} s grace); killing ssh",
                        c->spec.name, options_.grace_seconds));
        c->killed = true;
        close_fd(c->in);
        if (c->may_signal()) ::kill(-c->pid, SIGKILL);
      } else if (now >= due) {
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

  // Writes a child's lines; an ssh child's lines of its own are also kept for its failure message.
  void emit(Child& c, const std::string& lines, int to) {
    write_all(to, lines);
    if (!c.spec.remote) return;
    const std::string mark = "[ssh " + c.spec.host + "] ";
    for (size_t at = lines.find(mark); at != std::string::npos; at = lines.find(mark, at + 1))
      c.ssh_said += lines.substr(at, lines.find('\n', at) - at + 1);
    if (c.ssh_said.size() > 4096) c.ssh_said.erase(0, c.ssh_said.size() - 4096);
  }

  // One read per wake-up keeps a chatty rank from starving the others.
  void pump(Child& c, int& fd, LinePrefixer& lines, int to) {
    if (fd < 0) return;
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      emit(c, lines.feed(std::string_view(buf, static_cast<size_t>(n))), to);
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      emit(c, lines.flush(), to);
      close_fd(fd);
    }
  }

  void drain(Child& c, int& fd, LinePrefixer& lines, int to) {
    while (fd >= 0) {
      char buf[65536];
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        emit(c, lines.feed(std::string_view(buf, static_cast<size_t>(n))), to);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      emit(c, lines.flush(), to);  // EOF, or a writer that escaped its group still holds it
      close_fd(fd);
    }
  }

  SuperviseOptions options_;
  std::vector<std::unique_ptr<Child>> children_;
  sigset_t old_mask_{};
  int signal_fd_ = -1;
  bool watching_stdin_ = false;
  std::string stdin_text_;  // a partial line from the head
  bool signalled_ = false;
  bool stopping_ = false;
  bool sweep_due_ = false;  // a SIGCHLD came
  int exit_code_ = 0;
  Clock::time_point kill_at_, next_sweep_;
};

}  // namespace

int supervise(const std::vector<ChildSpec>& children, const SuperviseOptions& options) {
  return Supervisor(children, options).run();
}

}  // namespace strata::launcher
