// Starts the processes of a launch and supervises them until none is left.
//
// - Each child leads its own process group (setpgid), so stopping a rank also stops what it
//   started (`bash -c '...; sleep 600'`), and Ctrl-C at the terminal reaches only the launcher,
//   which forwards it. Groups are signalled by number, and a number is free for reuse once its
//   group is empty and its leader reaped; so a child that exits is noted but not reaped
//   (waitid WNOWAIT) until its group has no live member left, and its group is never signalled
//   after that. The launcher is a child subreaper: the orphans of a group come here and are
//   reaped, and /proc (process_table.h) tells when a group is empty.
// - Each child gets PR_SET_PDEATHSIG(SIGKILL): if the launcher itself is killed, its ranks die.
// - stdout and stderr come back through pipes, line by line, prefixed, each to the launcher's own
//   stdout and stderr. Ranks read /dev/null: a background process group reading the terminal
//   would otherwise stop on SIGTTIN.
// - The first event decides the exit code: a child exiting non-zero (its code) or killed
//   (128+signal), or a SIGINT/SIGTERM/SIGHUP to the launcher (128+signal, after forwarding it).
//   Then every child's group gets that signal (SIGTERM for a failure), and SIGKILL once the grace
//   period has passed; a second signal to the launcher sends SIGKILL at once. When all children
//   exit 0, leftovers in their groups are stopped the same way and the code is 0.
// - An ssh child's stdin first carries its stdin_text (the exported variables, which stay off
//   every command line); the pipe is sized to hold it, so writing it never blocks.
// - An ssh child (remote) is not signalled: the stop travels through its stdin, a pipe held here,
//   as a line "stop N" (the same signal N as the local ranks get: SIGINT for Ctrl-C, SIGTERM
//   for a failure) and, on a second signal, "kill"; the node launcher at the other end
//   (--watch-stdin) signals its ranks and kills them after its own grace period, which is the
//   head's. A closed stdin without a stop line (the head or the link is gone) stops them with
//   SIGTERM. ssh itself is killed when it has not ended 3 s after the grace period.
// - A remote node's lines arrive as its node launcher prefixed them; other lines (ssh's own
//   messages, the remote shell's) get "[ssh HOST] ". When ssh fails (its code 255) or the remote
//   shell cannot run strata-run (127), the message says why in words: no answer within the
//   connect timeout, connection refused, login refused, name unknown, connection dropped.
#pragma once

#include <string>
#include <vector>

#include "launcher/ssh.h"

namespace strata::launcher {

struct ChildSpec {
  std::string name;    // for messages: "rank 3", "node 1 (worker-1)"
  std::string prefix;  // put before each output line; empty for ssh (the node launcher prefixes)
  std::string path;    // the file to execute
  std::vector<std::string> argv;
  EnvList env;  // set over the launcher's environment
  bool remote = false;
  std::string stdin_text;  // an ssh child's: written to its stdin first (ssh.h's env_block)
  // For an ssh child's failure messages:
  std::string host;             // as the hostfile names it
  std::string remote_launcher;  // the path the remote shell runs
  int connect_timeout = 0;      // ssh's ConnectTimeout, seconds
};

struct SuperviseOptions {
  double grace_seconds = 5;
  bool watch_stdin = false;  // a closed stdin acts as SIGTERM (node launcher under ssh)
  std::string label;         // a node launcher's "node K, HOST": its messages name it
};

// Runs the children to the end; returns the launcher's exit code.
int supervise(const std::vector<ChildSpec>& children, const SuperviseOptions& options);

}  // namespace strata::launcher
