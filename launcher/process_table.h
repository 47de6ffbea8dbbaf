// The processes of this machine as /proc shows them. The supervisor keeps an exited rank's leader
// unreaped while it may still signal the rank's process group (see supervisor.h), so kill(-pgid, 0)
// cannot tell it when the group is empty: a zombie leader answers too. This table can: a group is
// empty once none of its members is anything but a zombie. It also lists the orphans the
// supervisor inherited as a subreaper, which it reaps one by one (waitpid(-1) would reap the
// leaders it keeps).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace strata::launcher {

struct ProcessInfo {
  pid_t pid = 0, ppid = 0, pgrp = 0;
  char state = '?';  // /proc/PID/stat's: R, S, D, T, ..., Z (zombie), X (dead)
  bool dead() const { return state == 'Z' || state == 'X'; }
};

// One /proc/PID/stat line ("PID (COMM) STATE PPID PGRP ..."; COMM may hold spaces and ')');
// false if it does not parse.
bool parse_proc_stat(const std::string& line, ProcessInfo& out);

// Every process /proc lists. Not a snapshot: processes start and exit while it is read.
std::vector<ProcessInfo> list_processes();

}  // namespace strata::launcher
