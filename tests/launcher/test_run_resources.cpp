// What strata-run holds on its ranks' behalf and what they inherit from it: an exited rank's
// process group keeps its number for as long as the launcher may signal it, and a rank starts
// with no descriptor of the launcher's, nor does the launcher keep the pipes of a rank it could
// not start.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "launcher/process_table.h"
#include "launcher_process.h"

namespace strata::test {
namespace {

// A launcher under RLIMIT_NOFILE `files`, ignoring SIGTERM.
LaunchSetup limited(int files) {
  LaunchSetup setup;
  setup.max_open_files = files;
  setup.ignore_sigterm = true;
  return setup;
}

launcher::ProcessInfo process(pid_t pid) {
  launcher::ProcessInfo info;
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(file, line) || !launcher::parse_proc_stat(line, info)) info.state = '-';
  return info;
}

// The launcher signals a stopped job's groups by number (killpg), and a number is free for a new
// process once its group is empty and its leader reaped. So a rank that exited while its group
// still has a member must stay an unreaped zombie until that member is gone: otherwise, once the
// member exits, an unrelated process could own the number by the time a signal follows.
//
// The test ends the stop itself, once it has looked: the grace period is longer than any run, so
// no check here races it. (With a 3 s grace the SIGKILL could come while the checks still ran on
// a loaded machine, count_processes' walk over every process of it above all, and the test then
// failed on a group the launcher had rightly killed and reaped: "count_processes(marker) Which
// is: 1" (0 once the launcher was gone as well).)
TEST(LauncherResources, ExitedRankStaysUnreapedWhileItsGroupMayBeSignalled) {
  const std::string marker = unique_sleep(11);
  LauncherProcess launcher(
      {"--grace", "600", "--", "bash", "-c",
       "trap '' TERM; sleep " + marker + " & echo leader $$ member $!; exit 3"});
  ASSERT_TRUE(launcher.wait_for_stdout("member", 1, 30));
  ASSERT_TRUE(
      launcher.wait_for_stderr("rank 0 exited with code 3; stopping the other ranks", 1, 30))
      << launcher.out();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(launcher.out(), m,
                                std::regex(R"(\[rank 0\] leader (\d+) member (\d+))")));
  const pid_t leader = std::stoi(m[1]), member = std::stoi(m[2]);
  // The member (the sleep) ignores the SIGTERM the failure sent: its group lives until the end.
  for (int i = 0; i < 5; ++i) {
    const launcher::ProcessInfo p = process(leader), q = process(member);
    EXPECT_EQ(p.state, 'Z') << "rank 0 (pid " << leader << ") was reaped while its group lives";
    EXPECT_EQ(p.ppid, launcher.pid());
    EXPECT_TRUE(q.state != '-' && !q.dead()) << "the sleep (pid " << member << ") is gone";
    EXPECT_EQ(q.pgrp, leader);
    EXPECT_EQ(q.ppid, launcher.pid());  // the subreaper inherited it
    if (p.state != 'Z') break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // The sleep and the launcher's own command line (polled: mid-execve a command line reads empty).
  EXPECT_EQ(wait_for_count(marker, 2, 30), 2);
  // A first signal is forwarded (the sleep ignores it too); a second one SIGKILLs every group at
  // once, this one through the number its zombie leader still holds.
  launcher.signal(SIGTERM);
  ASSERT_TRUE(launcher.wait_for_stderr("forwarding it to every rank", 1, 30)) << launcher.out();
  EXPECT_EQ(process(leader).state, 'Z');
  launcher.signal(SIGTERM);
  Finished r = launcher.wait(60);
  EXPECT_EQ(r.code, 3) << r.err;  // the failure came first
  EXPECT_NE(r.err.find("killing every rank now"), std::string::npos) << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

// The grace period ends the same way for a group whose leader has exited: SIGKILL through the
// zombie's number, and the launcher is done once the group is empty. Only its end is checked.
TEST(LauncherResources, ExitedRanksGroupIsKilledAfterTheGracePeriod) {
  const std::string marker = unique_sleep(13);
  Finished r = run_launcher(
      {"--grace", "1", "--", "bash", "-c", "trap '' TERM; sleep " + marker + " & exit 3"},
      {}, 60);
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_GE(r.seconds, 1);
  EXPECT_NE(r.err.find("rank 0 still running 1 s after the stop signal; sending SIGKILL"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

// Rank i's descriptors as `ls` lists them, from "[rank i] FD" lines.
std::map<int, std::set<int>> fds_by_rank(const std::string& out) {
  std::map<int, std::set<int>> fds;
  std::regex line(R"(\[rank (\d+)\] (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
       ++it)
    fds[std::stoi((*it)[1])].insert(std::stoi((*it)[2]));
  return fds;
}

TEST(LauncherResources, RankInheritsOnlyItsStandardDescriptors) {
  const std::vector<int> inherited = inherited_fds();  // passed through as they were
  std::set<int> expected(inherited.begin(), inherited.end());
  expected.insert({0, 1, 2});
  Finished r = run_launcher({"--nproc-per-node", "2", "--", "bash", "-c", "ls /proc/$$/fd; true"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto fds = fds_by_rank(r.out);
  ASSERT_EQ(fds.size(), 2u) << r.out;
  for (const auto& [rank, open] : fds)
    EXPECT_EQ(open, expected) << "rank " << rank << ":\n" << r.out;
}

// The pipes the launcher holds itself (its own stdout and stderr and what it inherited aside).
int pipes_held(pid_t pid, const std::vector<int>& inherited) {
  int pipes = 0;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* fds = ::opendir(dir.c_str());
  while (dirent* e = fds ? ::readdir(fds) : nullptr) {
    const int fd = std::atoi(e->d_name);
    if (fd <= 2 || std::count(inherited.begin(), inherited.end(), fd)) continue;
    char target[256] = {};
    if (::readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1) > 0)
      pipes += std::string(target).rfind("pipe:", 0) == 0;
  }
  if (fds) ::closedir(fds);
  return pipes;
}

// Rank 1 cannot get its pipes (RLIMIT_NOFILE, raised one by one until both ranks start): the
// launcher must hold only rank 0's two read ends, whichever of rank 1's pipes failed. Rank 0
// ignores the SIGTERM that rank 1's failure sends from the moment it starts, so the launcher
// waits out the grace period while its descriptors are counted.
TEST(LauncherResources, RankThatCannotStartLeavesNoPipesBehind) {
  const std::string marker = unique_sleep(12);
  const std::vector<int> inherited = inherited_fds();
  int cut_short = 0;
  for (int limit = 4; limit < 64 + static_cast<int>(inherited.size()); ++limit) {
    LauncherProcess launcher({"--grace", "5", "--nproc-per-node", "2", "--", "bash", "-c",
                              "echo ready; exec sleep " + marker},
                             {}, limited(limit));
    // No rank started under this limit (or the launcher could not even watch signals).
    if (!launcher.wait_for_stdout("ready", 1, 10)) continue;
    // Every start was tried before any output was read, so the count is final.
    const int pipes = pipes_held(launcher.pid(), inherited);
    launcher.signal(SIGKILL);  // its ranks die with it (PR_SET_PDEATHSIG)
    Finished r = launcher.wait(10);
    if (r.err.find("cannot create pipes for rank 1") == std::string::npos) break;  // both ran
    ++cut_short;
    EXPECT_EQ(pipes, 2) << "RLIMIT_NOFILE " << limit << "\n" << r.err;
  }
  EXPECT_GE(cut_short, 1);
  EXPECT_EQ(wait_for_count(marker, 0, 5), 0);
}

}  // namespace
}  // namespace strata::test
