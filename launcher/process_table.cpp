#include "launcher/process_table.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace strata::launcher {

bool parse_proc_stat(const std::string& line, ProcessInfo& out) {
  const size_t close = line.rfind(')');  // COMM is the only field that can hold ')'
  if (close == std::string::npos) return false;
  ProcessInfo info;
  int pid = 0, ppid = 0, pgrp = 0;
  if (std::sscanf(line.c_str(), "%d", &pid) != 1 ||
      std::sscanf(line.c_str() + close + 1, " %c %d %d", &info.state, &ppid, &pgrp) != 3)
    return false;
  info.pid = pid;
  info.ppid = ppid;
  info.pgrp = pgrp;
  out = info;
  return true;
}

std::vector<ProcessInfo> list_processes() {
  std::vector<ProcessInfo> table;
  DIR* proc = ::opendir("/proc");
  if (!proc) return table;
  while (dirent* entry = ::readdir(proc)) {
    char* end = nullptr;
    std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || end == entry->d_name) continue;  // not a PID
    const std::string path = std::string("/proc/") + entry->d_name + "/stat";
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // exited and reaped since readdir
    char buf[1024];
    const ssize_t n = ::read(fd, buf, sizeof buf - 1);
    ::close(fd);
    ProcessInfo info;
    if (n > 0 && parse_proc_stat(std::string(buf, static_cast<size_t>(n)), info))
      table.push_back(info);
  }
  ::closedir(proc);
  return table;
}

}  // namespace strata::launcher
