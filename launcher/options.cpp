// The command line: torchrun's spellings (--nproc-per-node, --node-rank, ...) and DeepSpeed's
// (--num_gpus, --hostfile, -i/-e, ...) land in the same fields, so either habit works.
#include "launcher/options.h"

#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <map>

namespace strata::launcher {
namespace {

int to_int(const std::string& option, const std::string& value, int min) {
  size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || n < min)
    throw UsageError(fmt::format("{} expects an integer >= {}, got '{}'", option, min, value));
  return n;
}

double to_seconds(const std::string& option, const std::string& value) {
  size_t used = 0;
  double s = -1;
  try {
    s = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || !(s >= 0))
    throw UsageError(fmt::format("{} expects seconds >= 0, got '{}'", option, value));
  return s;
}

using Setter = std::function<void(LauncherOptions&, const std::string& name, const std::string&)>;

// Options that take a value. Both '-' and '_' spellings are accepted for every long name.
const std::map<std::string, Setter>& valued() {
  static const std::map<std::string, Setter> table = {
      {"--hostfile", [](auto& o, auto&, auto& v) { o.hostfile = v; }},
      {"--include", [](auto& o, auto&, auto& v) { o.include = v; }},
      {"--exclude", [](auto& o, auto&, auto& v) { o.exclude = v; }},
      {"--num-nodes", [](auto& o, auto& n, auto& v) { o.num_nodes = to_int(n, v, 1); }},
      {"--nnodes", [](auto& o, auto& n, auto& v) { o.num_nodes = to_int(n, v, 1); }},
      {"--num-gpus", [](auto& o, auto& n, auto& v) { o.num_gpus = to_int(n, v, 1); }},
      {"--nproc-per-node", [](auto& o, auto& n, auto& v) { o.num_gpus = to_int(n, v, 1); }},
      {"--node-rank", [](auto& o, auto& n, auto& v) { o.node_rank = to_int(n, v, 0); }},
      {"--master-addr", [](auto& o, auto&, auto& v) { o.master_addr = v; }},
      {"--master-port", [](auto& o, auto& n, auto& v) { o.master_port = to_int(n, v, 1); }},
      {"--export", [](auto& o, auto&, auto& v) { o.exports.push_back(v); }},
      {"--grace", [](auto& o, auto& n, auto& v) { o.grace_seconds = to_seconds(n, v); }},
      {"--config", [](auto& o, auto&, auto& v) { o.config = v; }},
      {"--ssh-config", [](auto& o, auto&, auto& v) { o.ssh_config = v; }},
      {"--ssh-port", [](auto& o, auto& n, auto& v) { o.ssh_port = to_int(n, v, 1); }},
      {"--ssh-connect-timeout",
       [](auto& o, auto& n, auto& v) { o.ssh_connect_timeout = to_int(n, v, 1); }},
      {"--world-info", [](auto& o, auto&, auto& v) { o.world_info = v; }},
      {"--chdir", [](auto& o, auto&, auto& v) { o.chdir = v; }},
  };
  return table;
}

const std::map<std::string, std::string>& short_names() {
  static const std::map<std::string, std::string> table = {
      {"-H", "--hostfile"}, {"-i", "--include"}, {"-e", "--exclude"}};
  return table;
}

std::string canonical(std::string name) {
  if (auto it = short_names().find(name); it != short_names().end()) return it->second;
  for (size_t i = 2; i < name.size(); ++i)
    if (name[i] == '_') name[i] = '-';
  return name;
}

// Levenshtein distance, for "did you mean".
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string nearest(const std::string& name) {
  std::vector<std::string> known = {"--help", "--dry-run", "--watch-stdin", "--env-stdin"};
  for (const auto& [k, _] : valued()) known.push_back(k);
  std::string best;
  size_t best_d = 4;
  for (const auto& k : known)
    if (size_t d = distance(name, k); d < best_d) best = k, best_d = d;
  return best.empty() ? "" : fmt::format(" (did you mean {}?)", best);
}

}  // namespace

std::optional<LauncherOptions> parse_command_line(const std::vector<std::string>& args) {
  LauncherOptions o;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-') break;  // like torchrun: the first word starts the program
    size_t eq = arg.find('=');
    std::string name = canonical(arg.substr(0, eq));
    if (name == "--help" || name == "-h") {
      std::fputs(usage(), stdout);
      return std::nullopt;
    }
    if (name == "--dry-run" || name == "--watch-stdin" || name == "--env-stdin") {
      if (eq != std::string::npos) throw UsageError(fmt::format("{} takes no value", name));
      bool& flag = name == "--dry-run"     ? o.dry_run
                   : name == "--env-stdin" ? o.env_stdin
                                           : o.watch_stdin;
      flag = true;
      continue;
    }
    auto it = valued().find(name);
    if (it == valued().end())
      throw UsageError(fmt::format("unknown option {}{}", arg.substr(0, eq), nearest(name)));
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      throw UsageError(fmt::format("{} needs a value", arg));
    }
    it->second(o, name, value);
  }
  o.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (o.program.empty())
    throw UsageError("no program given: strata-run [options] -- PROGRAM ARGS...");
  return o;
}

LauncherOptions merge(const LauncherOptions& command_line, const LauncherOptions& from_config) {
  const LauncherOptions& c = command_line;
  const LauncherOptions& f = from_config;
  LauncherOptions m = c;
  auto fill = [](auto& field, const auto& fallback) {
    if (!field) field = fallback;
  };
  if (!m.hostfile) m.hostfile = f.hostfile, m.hostfile_named_by = f.hostfile_named_by;
  // One choice of slots: a filter on the command line replaces the block's whole choice, and a
  // count there replaces the block's filter (DeepSpeed refuses the two together).
  const bool filter_given = c.include || c.exclude;
  const bool count_given = c.num_nodes || c.num_gpus;
  if (!filter_given && !count_given) m.include = f.include, m.exclude = f.exclude;
  if (!filter_given) {
    fill(m.num_nodes, f.num_nodes);
    fill(m.num_gpus, f.num_gpus);
  }
  fill(m.node_rank, f.node_rank);
  fill(m.master_addr, f.master_addr);
  fill(m.master_port, f.master_port);
  fill(m.grace_seconds, f.grace_seconds);
  fill(m.ssh_config, f.ssh_config);
  fill(m.ssh_port, f.ssh_port);
  fill(m.ssh_connect_timeout, f.ssh_connect_timeout);
  fill(m.chdir, f.chdir);
  fill(m.world_info, f.world_info);
  m.dry_run = c.dry_run || f.dry_run;
  m.watch_stdin = c.watch_stdin || f.watch_stdin;
  m.env_stdin = c.env_stdin || f.env_stdin;
  if (m.program.empty()) m.program = f.program;
  if (m.argv0.empty()) m.argv0 = f.argv0;
  // Later entries win when the environment is built, so the command line goes last.
  m.exports = f.exports;
  m.exports.insert(m.exports.end(), c.exports.begin(), c.exports.end());
  return m;
}

const char* usage() {
  return R"(usage: strata-run [options] [--] PROGRAM ARGS...

Starts one process per rank and waits for them. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK (= NODE_RANK), GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and a
CUDA_VISIBLE_DEVICES naming one GPU (an index into the launcher's own list when it has one).
Output lines are prefixed "[rank N] "; stdout and stderr stay apart.

torchrun-style (one launcher per machine):
  --nproc-per-node N, --num_gpus N   ranks on this node (default: the GPUs visible here, else 1)
  --nnodes N, --num_nodes N          machines in the job (default 1)
  --node-rank K                      this machine's index (default 0)
  --master-addr ADDR                 rendezvous host (default 127.0.0.1; needed with --nnodes > 1)
  --master-port PORT                 rendezvous port (default: a free one; 29500 with --nnodes > 1)

DeepSpeed-style (one launcher for the job, remote hosts over ssh):
  -H, --hostfile FILE                lines "HOST slots=N"; '#' starts a comment. HOST as ssh takes
                                     it: a name or ssh config alias, USER@HOST, an IPv6 address
  -i, --include SPEC                 use only these slots: NAME[:SLOT[,SLOT...]][@NAME...]; a host
                                     by its name without USER@, an IPv6 one in brackets ([::1]:0)
  -e, --exclude SPEC                 use all but these slots (same syntax)
  --num_nodes N                      the first N hosts;  --num_gpus N: slots 0..N-1 of each
  --master-addr ADDR                 default: node 0 as the other hosts reach it (for a remote node
                                     0, the host name ssh connects to, an alias's HostName; for this
                                     machine, its address on the route to the other hosts)
  --ssh-config FILE                  ssh -F FILE (default: ssh's own, ~/.ssh/config)
  --ssh-port PORT, --ssh_port PORT   ssh -p PORT
  --ssh-connect-timeout SECONDS      ssh's ConnectTimeout, which also bounds its handshake (10)
  Hosts named localhost, 127.0.0.1 or this machine's name run here; each other host gets one
  "ssh -T -o BatchMode=yes -o ConnectTimeout=10 HOST 'exec strata-run --chdir DIR ...'" that
  starts its ranks. DIR is this working folder and strata-run this launcher as typed ($PWD and
  argv[0], links kept; STRATA_REMOTE_LAUNCHER names another path): each host needs them there.
  Remote ranks get the --export variables, the lines NAME=VALUE of ~/.strata_env and ./.strata_env
  (as DeepSpeed's .deepspeed_env; every rank gets those), and this environment's NCCL_* and
  STRATA_*; nothing else of it.

Other:
  --export NAME[=VALUE]              set on every rank, and pass to remote hosts (NAME_* matches
                                     a prefix)
  --grace SECONDS                    SIGTERM -> SIGKILL delay when stopping ranks (default 5), on
                                     every host
  --dry-run                          print the command lines it would run, one per line; start none
  -h, --help                         this text
  --version                          Strata's version and what it was built with
  (--world-info, --watch-stdin, --env-stdin and --chdir are what the head launcher passes to the
  remote nodes; --env-stdin reads the exported variables from stdin, never the command line)

Every job gets a secret, STRATA_JOB_SECRET (taken from the environment when set there, else made
here): ranks prove it to join the rendezvous store. It reaches the ranks through their
environment, and remote hosts through ssh's stdin, never a command line.

If a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL after the grace
period; the exit code is the first failing rank's (128+N when killed by signal N). SIGINT,
SIGTERM and SIGHUP are forwarded to every rank, remote ones too (through their node launcher);
the launcher then exits 128+N.
)";
}

}  // namespace strata::launcher
