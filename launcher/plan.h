// LaunchPlan: the options resolved into what to start — the world (every node and its GPU slots),
// the rendezvous address, the ranks that run on this machine with their environment, and one ssh
// command per remote node. Everything is checked here, before anything starts: main() either
// prints the plan (--dry-run) or hands it to the supervisor.
#pragma once

#include <string>
#include <vector>

#include "launcher/hostfile.h"
#include "launcher/options.h"
#include "launcher/ssh.h"

namespace strata::launcher {

struct LocalRank {
  int rank = 0;
  EnvList env;  // RANK, WORLD_SIZE, ... and the exports, set over the inherited environment
};

struct RemoteNode {
  std::string host;
  int node_rank = 0;
  std::vector<std::string> argv;  // ssh ... HOST 'exec strata-run --env-stdin --chdir DIR ...'
  EnvList env;  // the variables its ranks get, for ssh's stdin (ssh.h's env_block), secret aside
};

struct LaunchPlan {
  Resources world;  // node rank = index
  std::string master_addr;
  int master_port = 0;
  std::vector<std::string> program;  // as given; argv[0] is what the ranks see
  std::string program_path;          // resolved through PATH; empty when no rank runs here
  std::vector<LocalRank> local;
  std::vector<RemoteNode> remote;
  double grace_seconds = 5;
  bool watch_stdin = false;
  SshOptions ssh;               // how the remote nodes are reached
  std::string remote_launcher;  // what they run: strata-run as typed, or STRATA_REMOTE_LAUNCHER
  std::string label;            // a node launcher's "node K, HOST", for its messages
  // STRATA_JOB_SECRET for every rank (local ones through their environment, remote ones through
  // ssh's stdin): the environment's, else made here when this launcher starts the whole job;
  // "" for one node of a torchrun-style job started by hand without it. Never printed.
  std::string secret;
};

LaunchPlan make_plan(const LauncherOptions& options);

// Before the local ranks start (not for --dry-run): the master address resolves here, so a name
// only ssh knows fails now, naming it, and not after STRATA_TIMEOUT in every rank. Returns a
// warning ("" if none) when this machine runs node 0 but the address is none of its own. A
// master that is a name for this host's loopback (Debian's 127.0.1.1) while other hosts take part
// is an error naming it.
std::string check_master_address(const LaunchPlan& plan);

// --dry-run: one shell command line per process that would start: `A=1 B=2 PROGRAM ARGS` for a
// local rank (only the variables the launcher sets), the full ssh line for a remote node followed
// by "  # stdin: A=1 B=2" (what travels on its stdin). The job's secret is never printed.
std::vector<std::string> command_lines(const LaunchPlan& plan);

}  // namespace strata::launcher
