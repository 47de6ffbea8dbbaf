#include "launcher_process.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "launcher/net.h"

namespace strata::test {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

std::string launcher_path() {
  char resolved[PATH_MAX] = {};
  std::string path = std::string(STRATA_BIN_DIR) + "/strata-run";
  return ::realpath(path.c_str(), resolved) ? resolved : path;
}

std::string typed_cwd() {
  const char* pwd = std::getenv("PWD");
  struct stat typed {}, here {};
  if (pwd && pwd[0] == '/' && ::stat(pwd, &typed) == 0 && ::stat(".", &here) == 0 &&
      typed.st_dev == here.st_dev && typed.st_ino == here.st_ino)
    return pwd;
  char cwd[PATH_MAX] = {};
  return ::getcwd(cwd, sizeof cwd) ? cwd : "";
}

LauncherProcess::LauncherProcess(const std::vector<std::string>& args, const EnvChanges& env,
                                 const LaunchSetup& setup) {
  int out[2], err[2], in[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) std::abort();
  if (setup.stdin_pipe && ::pipe2(in, O_CLOEXEC) != 0) std::abort();
  const std::string path = setup.launcher.empty() ? launcher_path() : setup.launcher;
  std::vector<char*> argv = {const_cast<char*>(path.c_str())};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  started_ = now();
  pid_ = ::fork();
  if (pid_ == 0) {
    for (const auto& [name, value] : env)
      value ? ::setenv(name.c_str(), value->c_str(), 1) : ::unsetenv(name.c_str());
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    if (setup.stdin_pipe) ::dup2(in[0], STDIN_FILENO);
    if (!setup.directory.empty()) {
      if (::chdir(setup.directory.c_str()) != 0) ::_exit(125);
      ::setenv("PWD", setup.directory.c_str(), 1);
    }
    rlimit files{};
    ::getrlimit(RLIMIT_NOFILE, &files);
    files.rlim_cur = static_cast<rlim_t>(setup.max_open_files);
    if (setup.max_open_files > 0) ::setrlimit(RLIMIT_NOFILE, &files);
    if (setup.ignore_sigterm) ::signal(SIGTERM, SIG_IGN);
    ::execv(path.c_str(), argv.data());
    ::_exit(126);
  }
  ::close(out[1]);
  ::close(err[1]);
  if (setup.stdin_pipe) ::close(in[0]);
  in_ = in[1];
  out_ = out[0];
  err_ = err[0];
}

LauncherProcess::~LauncherProcess() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (out_ >= 0) ::close(out_);
  if (err_ >= 0) ::close(err_);
  if (in_ >= 0) ::close(in_);
}

bool LauncherProcess::read_some(int timeout_ms) {
  std::vector<pollfd> fds;
  if (out_ >= 0) fds.push_back({out_, POLLIN, 0});
  if (err_ >= 0) fds.push_back({err_, POLLIN, 0});
  if (fds.empty()) return false;
  ::poll(fds.data(), fds.size(), timeout_ms);
  for (const pollfd& p : fds) {
    if (!p.revents) continue;
    char buf[65536];
    ssize_t n = ::read(p.fd, buf, sizeof buf);
    int& fd = p.fd == out_ ? out_ : err_;
    std::string& to = p.fd == out_ ? result_.out : result_.err;
    if (n > 0) {
      to.append(buf, static_cast<size_t>(n));
    } else {
      ::close(fd);
      fd = -1;
    }
  }
  return true;
}

bool LauncherProcess::wait_for_stdout(const std::string& text, int count, double timeout_s) {
  return wait_for(result_.out, text, count, timeout_s);
}

bool LauncherProcess::wait_for_stderr(const std::string& text, int count, double timeout_s) {
  return wait_for(result_.err, text, count, timeout_s);
}

bool LauncherProcess::wait_for(const std::string& output, const std::string& text, int count,
                               double timeout_s) {
  const double deadline = now() + timeout_s;
  while (occurrences(output, text) < static_cast<size_t>(count)) {
    if (now() > deadline || !read_some(100)) return false;
  }
  return true;
}

void LauncherProcess::signal(int sig) { ::kill(pid_, sig); }

void LauncherProcess::write_stdin(const std::string& text) {
  if (in_ >= 0) (void)!::write(in_, text.data(), text.size());
}

void LauncherProcess::close_stdin() {
  if (in_ >= 0) ::close(in_);
  in_ = -1;
}

Finished LauncherProcess::wait(double timeout_s) {
  const double deadline = now() + timeout_s;
  while (true) {
    if (!reaped_ && ::waitpid(pid_, &status_, WNOHANG) == pid_) reaped_ = true;
    if (reaped_ && out_ < 0 && err_ < 0) break;
    if (now() > deadline) {
      ::kill(pid_, SIGKILL);
      if (!reaped_) ::waitpid(pid_, &status_, 0);
      reaped_ = true;
      result_.code = -1;
      result_.seconds = now() - started_;
      return result_;
    }
    if (!read_some(50)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  result_.code = WIFSIGNALED(status_) ? 128 + WTERMSIG(status_) : WEXITSTATUS(status_);
  result_.seconds = now() - started_;
  return result_;
}

Finished run_launcher(const std::vector<std::string>& args, const EnvChanges& env,
                      double timeout_s) {
  LauncherProcess launcher(args, env);
  return launcher.wait(timeout_s);
}

int count_processes(const std::string& marker) {
  int count = 0;
  DIR* proc = ::opendir("/proc");
  while (dirent* e = proc ? ::readdir(proc) : nullptr) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid == ::getpid()) continue;
    std::ifstream file(std::string("/proc/") + e->d_name + "/cmdline");
    std::stringstream text;
    text << file.rdbuf();
    std::string cmdline = text.str();  // empty for zombies
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    count += cmdline.find(marker) != std::string::npos;
  }
  if (proc) ::closedir(proc);
  return count;
}

int wait_for_count(const std::string& marker, int expected, double timeout_s) {
  const double deadline = now() + timeout_s;
  int count = count_processes(marker);
  while (count != expected && now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    count = count_processes(marker);
  }
  return count;
}

std::vector<int> inherited_fds() {
  std::vector<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  while (dirent* e = dir ? ::readdir(dir) : nullptr) {
    char* end = nullptr;
    const int fd = static_cast<int>(std::strtol(e->d_name, &end, 10));
    if (*end != '\0' || end == e->d_name || fd == ::dirfd(dir)) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) fds.push_back(fd);
  }
  if (dir) ::closedir(dir);
  std::sort(fds.begin(), fds.end());
  return fds;
}

int free_port() { return launcher::pick_free_port(); }

std::string unique_sleep(int which) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%02d%07d", which % 100, static_cast<int>(::getpid()));
  return std::string("600.") + digits;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> metrics_losses(const std::string& path) {
  std::vector<std::string> out;
  static const std::regex loss("\"loss\":([-0-9.eE+]+)");
  std::ifstream in(path);
  std::smatch m;
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, loss)) out.push_back(m[1]);
  return out;
}

}  // namespace strata::test
