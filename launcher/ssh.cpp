#include "launcher/ssh.h"

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

std::string remote_command(const EnvList& exports, const std::string& directory,
                           const std::vector<std::string>& launcher_and_args) {
  std::string command;
  if (!exports.empty()) {
    command = "export";
    for (const auto& [name, value] : exports) command += " " + name + "=" + shell_quote(value);
    command += "; ";
  }
  return command + "cd " + shell_quote(directory) + " && exec " + shell_join(launcher_and_args);
}

std::vector<std::string> ssh_argv(const std::string& host, const std::string& command) {
  return {"ssh", "-o", "BatchMode=yes", host, command};
}

}  // namespace strata::launcher
