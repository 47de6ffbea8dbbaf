// Remote command lines. The head launcher starts one ssh per remote host (pdsh-style fan-out),
// which runs `strata-run --env-stdin --chdir DIR --watch-stdin --node-rank K --world-info ...`
// there; that node launcher starts, prefixes and supervises the host's ranks itself. Only the
// launch settings travel as flags. The exported variables (--export, .strata_env, the head's
// NCCL_* and STRATA_*, and the job's secret STRATA_JOB_SECRET) travel on ssh's stdin, as the
// block env_block() writes and the node launcher reads first: what is on an ssh command line is
// visible to `ps` on both machines, what is on its stdin is not. Never the whole environment.
//
// ssh runs with -T (no terminal even where the user's ssh config asks for one: a remote tty
// would turn line ends into CR LF and keep the node launcher from seeing its stdin close),
// BatchMode (fail at once rather than wait for a password nobody will type) and a
// ConnectTimeout, which in OpenSSH also bounds the banner exchange and key exchange: a host
// whose sshd accepts TCP and never speaks fails after that many seconds.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace strata::launcher {

using EnvList = std::vector<std::pair<std::string, std::string>>;

constexpr int kDefaultConnectTimeout = 10;  // seconds, as pdsh's connect timeout

struct SshOptions {
  std::string config;  // -F FILE; empty: ssh's own (~/.ssh/config)
  int port = 0;        // -p PORT; 0: ssh's own (its config's Port, else 22)
  int connect_timeout = kDefaultConnectTimeout;
};

// Quotes a word for a POSIX shell; plain words stay as they are, so dry-run lines read easily.
std::string shell_quote(const std::string& word);
std::string shell_join(const std::vector<std::string>& words);

// `exec LAUNCHER ARGS...` as one string for the remote shell.
std::string remote_command(const std::vector<std::string>& launcher_and_args);

// The variables for a node launcher's stdin: "strata-env N\n", then N lines NAME=VALUE (in VALUE,
// backslash and newline written as \\ and \n), then "end\n".
std::string env_block(const EnvList& env);

// Reads that block from `fd` one byte at a time (what follows it, the head's stop lines, stays
// unread), within `timeout_s` and at most 4 MiB. Throws strata::Error saying what was wrong.
EnvList read_env_block(int fd, double timeout_s);

// ssh's argv: ssh -T -o BatchMode=yes -o ConnectTimeout=N [-F FILE] [-p PORT] HOST COMMAND.
std::vector<std::string> ssh_argv(const std::string& host, const std::string& command,
                                  const SshOptions& options);

// What ssh makes of HOST through the user's ssh config (`ssh -G`): the host name or address it
// connects to (an alias's HostName), the user and the port. nullopt when ssh cannot say (no ssh,
// an ssh without -G, a config error).
struct SshTarget {
  std::string hostname, user;
  int port = 22;
};
std::optional<SshTarget> ssh_resolve(const std::string& ssh, const std::string& host,
                                     const SshOptions& options);

}  // namespace strata::launcher
