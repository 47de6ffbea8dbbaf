#include "launcher/ssh.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <sstream>

#include "runtime/error.h"

namespace strata::launcher {

std::string shell_quote(const std::string& word) {
  static const std::string plain =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./-";
  if (!word.empty() && word.find_first_not_of(plain) == std::string::npos) return word;
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

std::string shell_join(const std::vector<std::string>& words) {
  std::string line;
  for (const std::string& w : words) line += (line.empty() ? "" : " ") + shell_quote(w);
  return line;
}

std::string remote_command(const std::vector<std::string>& launcher_and_args) {
  return "exec " + shell_join(launcher_and_args);
}

std::string env_block(const EnvList& env) {
  std::string block = "strata-env " + std::to_string(env.size()) + "\n";
  for (const auto& [name, value] : env) {
    block += name + "=";
    for (char c : value) block += c == '\\' ? "\\\\" : c == '\n' ? "\\n" : std::string(1, c);
    block += "\n";
  }
  return block + "end\n";
}

EnvList read_env_block(int fd, double timeout_s) {
  constexpr size_t kMaxBlock = 4u << 20;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string text;
  auto fail = [](const std::string& why) {
    throw Error("--env-stdin: " + why + " (the head launcher writes the variables there first)");
  };
  while (text.size() < 4 || text.compare(text.size() - 4, 4, "end\n") != 0 ||
         (text.size() > 4 && text[text.size() - 5] != '\n')) {
    if (text.size() >= kMaxBlock) fail("the block of variables on stdin is over 4 MiB");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) fail(fmt::format("no variables on stdin within {:g} s", timeout_s));
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char c;
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("stdin closed before the block of variables ended");
    text += c;
  }
  std::istringstream lines(text);
  std::string line;
  std::getline(lines, line);
  if (line.rfind("strata-env ", 0) != 0) fail("stdin does not start with 'strata-env N'");
  const size_t count = std::strtoul(line.c_str() + 11, nullptr, 10);
  EnvList env;
  for (size_t i = 0; i < count; ++i) {
    if (!std::getline(lines, line)) fail("the block of variables is cut short");
    const size_t eq = line.find('=');
    if (eq == std::string::npos || eq == 0) fail("a line of the block is not NAME=VALUE");
    std::string value;
    for (size_t k = eq + 1; k < line.size(); ++k) {
      if (line[k] == '\\' && k + 1 < line.size()) {
        ++k;
        value += line[k] == 'n' ? '\n' : line[k];
      } else {
        value += line[k];
      }
    }
    env.emplace_back(line.substr(0, eq), value);
  }
  if (!std::getline(lines, line) || line != "end") fail("the block of variables does not end");
  return env;
}

namespace {

std::vector<std::string> ssh_options(const SshOptions& options) {
  std::vector<std::string> argv = {"-o", "BatchMode=yes", "-o",
                                   "ConnectTimeout=" + std::to_string(options.connect_timeout)};
  if (!options.config.empty()) argv.insert(argv.end(), {"-F", options.config});
  if (options.port > 0) argv.insert(argv.end(), {"-p", std::to_string(options.port)});
  return argv;
}

// argv's stdout, or nullopt when it cannot run or exits non-zero. stdin and stderr: /dev/null.
std::optional<std::string> output_of(const std::string& path,
                                     const std::vector<std::string>& argv) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return std::nullopt;
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    ::dup2(null, STDIN_FILENO);
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(null, STDERR_FILENO);
    ::execv(path.c_str(), args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  if (pid < 0) return std::nullopt;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return out;
}

}  // namespace

std::vector<std::string> ssh_argv(const std::string& host, const std::string& command,
                                  const SshOptions& options) {
  std::vector<std::string> argv = {"ssh", "-T"};
  for (std::string& o : ssh_options(options)) argv.push_back(std::move(o));
  argv.insert(argv.end(), {host, command});
  return argv;
}

std::optional<SshTarget> ssh_resolve(const std::string& ssh, const std::string& host,
                                     const SshOptions& options) {
  std::vector<std::string> argv = {"ssh", "-G"};
  for (std::string& o : ssh_options(options)) argv.push_back(std::move(o));
  argv.push_back(host);
  const std::optional<std::string> out = output_of(ssh, argv);
  if (!out) return std::nullopt;
  SshTarget target;
  std::istringstream lines(*out);
  for (std::string key, value; lines >> key && std::getline(lines >> std::ws, value);) {
    if (key == "hostname") target.hostname = value;
    if (key == "user") target.user = value;
    if (key == "port") target.port = std::atoi(value.c_str());
  }
  if (target.hostname.empty()) return std::nullopt;
  return target;
}

}  // namespace strata::launcher
