// Remote command lines. The head launcher starts one ssh per remote host (pdsh-style fan-out),
// which runs `strata-run --watch-stdin --node-rank K --world-info ...` there; that node launcher
// starts, prefixes and supervises the host's ranks itself. Only the launch settings (as flags)
// and the variables named with --export (as an `export A=...;` prefix) travel, never the whole
// environment: what is on an ssh command line is visible to `ps` on both machines.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace strata::launcher {

using EnvList = std::vector<std::pair<std::string, std::string>>;

// Quotes a word for a POSIX shell; plain words stay as they are, so dry-run lines read easily.
std::string shell_quote(const std::string& word);
std::string shell_join(const std::vector<std::string>& words);

// `export A=1 B=2; cd DIR && exec LAUNCHER ARGS...` as one string for the remote shell.
std::string remote_command(const EnvList& exports, const std::string& directory,
                           const std::vector<std::string>& launcher_and_args);

// ssh's argv. BatchMode: fail at once rather than wait for a password nobody will type.
std::vector<std::string> ssh_argv(const std::string& host, const std::string& command);

}  // namespace strata::launcher
