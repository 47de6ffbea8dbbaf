// strata-run on one machine, with real processes: failure propagation, signals, nothing left
// behind, the per-rank environment, prefixed output, and the errors caught before any rank starts.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "launcher_process.h"

namespace strata::test {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(LauncherRun, VersionNamesStrataAndItsBuild) {
  Finished r = run_launcher({"--version"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("strata ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("(Torch "), std::string::npos) << r.out;
}

TEST(LauncherRun, FailingRankStopsTheOthersWithItsExitCode) {
  const std::string marker = unique_sleep(1);
  Finished r = run_launcher(
      {"--nproc-per-node", "4", "--", "bash", "-c", "test $RANK = 2 && exit 7; sleep " + marker});
  EXPECT_EQ(r.code, 7) << r.err;
  EXPECT_LT(r.seconds, 15);
  EXPECT_NE(r.err.find("rank 2 exited with code 7"), std::string::npos) << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

TEST(LauncherRun, RankKilledBySignalEndsTheJobWith128PlusSignal) {
  const std::string marker = unique_sleep(2);
  Finished r = run_launcher(
      {"--nproc_per_node=4", "--", "bash", "-c", "test $RANK = 1 && kill -9 $$; sleep " + marker});
  EXPECT_EQ(r.code, 137) << r.err;
  EXPECT_LT(r.seconds, 15);
  EXPECT_NE(r.err.find("rank 1 was killed by signal 9"), std::string::npos) << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

// SIGINT is forwarded to every rank's process group; the launcher then exits 128+SIGINT = 130.
TEST(LauncherRun, SigintStopsEveryRankAndReturns130) {
  const std::string marker = unique_sleep(3);
  LauncherProcess launcher(
      {"--nproc-per-node", "3", "--", "bash", "-c", "echo ready; sleep " + marker});
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 3, 10));
  launcher.signal(SIGINT);
  Finished r = launcher.wait(10);
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_NE(r.err.find("forwarding it to every rank"), std::string::npos) << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

// A rank that ignores SIGINT and SIGTERM (and so does its sleep) is SIGKILLed after --grace.
TEST(LauncherRun, RankIgnoringSignalsIsKilledAfterTheGracePeriod) {
  const std::string marker = unique_sleep(4);
  LauncherProcess launcher({"--grace", "1", "--nproc-per-node", "2", "--", "bash", "-c",
                            "trap '' INT TERM; echo ready; sleep " + marker + "; sleep " + marker});
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 2, 10));
  launcher.signal(SIGTERM);
  Finished r = launcher.wait(10);
  EXPECT_EQ(r.code, 143) << r.err;
  EXPECT_GE(r.seconds, 1);
  EXPECT_NE(r.err.find("sending SIGKILL"), std::string::npos) << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

// The ranks carry PR_SET_PDEATHSIG: a launcher killed outright takes its ranks with it.
TEST(LauncherRun, RanksDieWithAKilledLauncher) {
  const std::string marker = unique_sleep(5);
  LauncherProcess launcher({"--nproc-per-node", "2", "--", "sleep", marker});
  ASSERT_EQ(wait_for_count(marker, 3, 10), 3);  // the launcher's own command line, two ranks
  launcher.signal(SIGKILL);
  EXPECT_EQ(launcher.wait(10).code, 137);
  EXPECT_EQ(wait_for_count(marker, 0, 5), 0);
}

TEST(LauncherRun, EachRankSeesItsTorchrunEnvironment) {
  Finished r = run_launcher(
      {"--nproc-per-node", "3", "--export", "STRATA_TEST_VALUE=x y", "--", "bash", "-c",
       "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $NODE_RANK "
       "$MASTER_ADDR $MASTER_PORT $CUDA_VISIBLE_DEVICES \"$STRATA_TEST_VALUE\""},
      {{"CUDA_VISIBLE_DEVICES", "5,6,7"}});
  ASSERT_EQ(r.code, 0) << r.err;
  std::regex line(R"(\[rank (\d)\] (\d) 3 (\d) 3 0 0 127\.0\.0\.1 (\d+) (\d) x y)");
  std::map<int, std::smatch> by_rank;
  std::set<std::string> ports;
  for (const std::string& l : lines_of(r.out)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(l, m, line)) << l;
    int rank = std::stoi(m[1]);
    EXPECT_EQ(m[2], m[1]);                 // RANK matches the prefix
    EXPECT_EQ(m[3], m[1]);                 // LOCAL_RANK on one node
    EXPECT_EQ(std::stoi(m[5]), 5 + rank);  // indexes the launcher's own list
    ports.insert(m[4]);
    by_rank[rank] = m;
  }
  EXPECT_EQ(by_rank.size(), 3u);
  ASSERT_EQ(ports.size(), 1u);  // one port, picked free, shared by all
  EXPECT_GT(std::stoi(*ports.begin()), 0);
}

TEST(LauncherRun, GivenMasterPortAndSlotNumbersWithoutCudaVisibleDevices) {
  const std::string port = std::to_string(free_port());
  Finished r = run_launcher({"--nproc-per-node", "2", "--master-port", port, "--", "bash", "-c",
                             "echo $MASTER_PORT $CUDA_VISIBLE_DEVICES"},
                            {{"CUDA_VISIBLE_DEVICES", std::nullopt}});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank 0] " + port + " 0\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] " + port + " 1\n"), std::string::npos) << r.out;
}

// A master that is a name for this host's loopback (Debian maps the host name to 127.0.1.1)
// cannot be reached from the other machines of a multi-machine job: refused by name (issue 35).
TEST(LauncherRun, AMasterNameForTheLoopbackIsRefusedWithOtherMachines) {
  Finished r = run_launcher({"--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                             "--master-addr", "localhost", "--", "true"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("the master address 'localhost' resolves to "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("which the other hosts of the job cannot reach; give --master-addr this "
                       "host's address on their network"),
            std::string::npos)
      << r.err;
  // One machine: a loopback master is right.
  r = run_launcher({"--nproc-per-node", "1", "--master-addr", "localhost", "--", "true"});
  EXPECT_EQ(r.code, 0) << r.err;
}

// torchrun's multi-machine form: this launcher starts node 1's share; node 0 holds the master.
TEST(LauncherRun, NodeRankSelectsThisMachinesShareOfTheWorld) {
  Finished r = run_launcher({"--dry-run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node",
                             "2", "--master-addr", "10.0.0.1", "--", "/bin/echo", "hi"},
                            {{"CUDA_VISIBLE_DEVICES", "2,3"}});
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string common =
      "LOCAL_WORLD_SIZE=2 GROUP_RANK=1 NODE_RANK=1 GROUP_WORLD_SIZE=2 "
      "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 CUDA_VISIBLE_DEVICES=";
  EXPECT_EQ(r.out, "RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 " + common + "2 /bin/echo hi\n" +
                       "RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 " + common + "3 /bin/echo hi\n");

  r = run_launcher({"--nproc-per-node", "2", "--", "true"}, {{"CUDA_VISIBLE_DEVICES", "3"}});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("slot 1 needs device 1 of CUDA_VISIBLE_DEVICES, which lists only 1"),
            std::string::npos)
      << r.err;
}

TEST(LauncherRun, OutputIsPrefixedPerLineWithStdoutAndStderrApart) {
  Finished r = run_launcher({"--nproc-per-node", "2", "--", "bash", "-c",
                             "echo out $RANK; echo err $RANK >&2; echo two $RANK; "
                             "printf 'partial %s' $RANK"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const std::string& l : lines_of(r.out)) EXPECT_EQ(l.rfind("[rank ", 0), 0u) << l;
  for (int rank : {0, 1}) {
    const std::string p = "[rank " + std::to_string(rank) + "] ";
    const std::string n = std::to_string(rank);
    // Ranks interleave line by line; one rank's lines keep their order.
    const size_t out = r.out.find(p + "out " + n + "\n"), two = r.out.find(p + "two " + n + "\n");
    EXPECT_NE(out, std::string::npos) << r.out;
    EXPECT_NE(two, std::string::npos) << r.out;
    EXPECT_LT(out, two) << r.out;
    EXPECT_NE(r.out.find(p + "partial " + n + "\n"), std::string::npos) << r.out;
    EXPECT_NE(r.err.find(p + "err " + n + "\n"), std::string::npos) << r.err;
  }
  EXPECT_EQ(r.out.find("err"), std::string::npos);
  EXPECT_EQ(r.err.find("out"), std::string::npos);
}

TEST(LauncherRun, MissingProgramIsNamedBeforeAnyRankStarts) {
  Finished r = run_launcher({"--nproc-per-node", "2", "--", "strata-no-such-program", "x"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("'strata-no-such-program' not found in PATH"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");

  r = run_launcher({"--", "./no/such/file"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("'./no/such/file' does not exist"), std::string::npos) << r.err;
}

// --export names go into a remote shell: checked by hand, so a hostile 100 kB name is an error
// (libstdc++'s std::regex recursed once per character and overflowed the stack).
TEST(LauncherRun, HostileExportNamesAreRefused) {
  for (const std::string& entry : {std::string(100000, 'A') + "=x", std::string(100000, 'B') + "*",
                                   std::string("1BAD=x"), std::string("A B=x"), std::string("X*=1")}) {
    Finished r = run_launcher({"--export", entry, "--", "true"});
    EXPECT_EQ(r.code, 1) << entry.substr(0, 20);
    EXPECT_NE(r.err.find("expected NAME, NAME_* or NAME=VALUE"), std::string::npos)
        << r.err.substr(0, 300);
  }
  Finished r = run_launcher({"--export", "GOOD_NAME=1", "--export", "GOOD_*", "--", "true"});
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST(LauncherRun, ProgramThatIsNotExecutableIsAnError) {
  char dir_template[] = "/tmp/strata-launcher-XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  const std::string file = dir + "/script.sh";
  std::ofstream(file) << "#!/bin/sh\necho hi\n";
  Finished r = run_launcher({"--", file});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("'" + file + "' is not executable"), std::string::npos) << r.err;
  std::remove(file.c_str());
  ::rmdir(dir.c_str());
}

TEST(LauncherRun, MasterPortInUseIsAnErrorNamingThePort) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  const std::string marker = unique_sleep(6);
  Finished r =
      run_launcher({"--master-port", port, "--nproc-per-node", "2", "--", "sleep", marker});
  ::close(fd);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("master port " + port + " is not free"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(LauncherRun, BadOptionPrintsUsageAndExits2) {
  Finished r = run_launcher({"--nproc-per-nod", "2", "--", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("unknown option --nproc-per-nod (did you mean --nproc-per-node?)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("usage: strata-run"), std::string::npos);

  EXPECT_EQ(run_launcher({"--nproc-per-node", "two", "--", "true"}).code, 2);
  EXPECT_EQ(run_launcher({"--nproc-per-node", "2"}).code, 2);  // no program

  r = run_launcher({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("usage: strata-run"), std::string::npos);
}

}  // namespace
}  // namespace strata::test
