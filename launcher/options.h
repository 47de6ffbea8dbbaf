// LauncherOptions: what strata-run was asked to do, before any of it is resolved. Every field is
// optional so that merge() can tell "given" from "not given" when a config file's `launcher`
// block fills the same struct (the lead wires `--config FILE` through the config schema; nothing
// here parses JSON).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "runtime/error.h"

namespace strata::launcher {

// A bad command line: main() prints it with the usage and exits 2 (argparse's convention).
class UsageError : public Error {
 public:
  using Error::Error;
};

struct LauncherOptions {
  // DeepSpeed: a pdsh/MPI-style hostfile ("worker-0 slots=8") and a filter over its slots.
  std::optional<std::string> hostfile;
  std::string hostfile_named_by;  // where a hostfile from the config came from, for errors
  std::optional<std::string> include;  // NAME[:SLOT[,SLOT...]][@NAME...]
  std::optional<std::string> exclude;  // same syntax; mutually exclusive with include
  // --num_nodes / --nnodes: the first N hosts of the hostfile, or without one the number of
  // machines in a torchrun-style launch (each started by hand with its --node-rank).
  std::optional<int> num_nodes;
  // --num_gpus / --nproc-per-node: ranks per node (with a hostfile: slots 0..N-1 of each host).
  std::optional<int> num_gpus;
  std::optional<int> node_rank;  // torchrun: this machine's place among num_nodes
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  // NAME (value taken from this environment; NAME_* matches a prefix) or NAME=VALUE: set on every
  // rank, and the only variables besides the launch ones that travel to other hosts over ssh.
  std::vector<std::string> exports;
  std::optional<double> grace_seconds;  // SIGTERM -> SIGKILL delay when stopping ranks
  // ssh to the remote hosts: -F FILE, -p PORT (DeepSpeed's --ssh_port), ConnectTimeout seconds.
  std::optional<std::string> ssh_config;
  std::optional<int> ssh_port;
  std::optional<int> ssh_connect_timeout;
  std::optional<std::string> config;    // --config FILE, for the lead's config wiring

  bool dry_run = false;
  // Internal, set by the head launcher for each remote node it starts over ssh.
  std::optional<std::string> world_info;  // every node's slots, in the include syntax
  bool watch_stdin = false;  // stop the ranks when stdin closes (the ssh link or head is gone)
  bool env_stdin = false;    // read the exported variables from stdin first (ssh.h's env_block)
  std::optional<std::string> chdir;  // the working folder to enter first (the head's, as typed)

  // Not an option: strata-run as it was started (argv[0]), what remote hosts run by default.
  std::string argv0;

  std::vector<std::string> program;  // PROGRAM ARGS... (after "--")
};

// Parses argv (argv[0] excluded). Throws UsageError for an unknown option or a bad value.
// Returns nullopt for --help after printing the usage to stdout.
std::optional<LauncherOptions> parse_command_line(const std::vector<std::string>& args);

// The command line wins over the config block field by field; exports are combined (the command
// line's NAME=VALUE replaces the block's value for the same NAME). The choice of slots counts as
// one: if the command line gives --include/--exclude, the block's include, exclude, num_nodes and
// num_gpus are ignored; if it gives --num_nodes or --num_gpus, the block's include/exclude are.
LauncherOptions merge(const LauncherOptions& command_line, const LauncherOptions& from_config);

const char* usage();

}  // namespace strata::launcher
