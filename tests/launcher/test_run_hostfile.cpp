// strata-run with a hostfile: the exact command lines of --dry-run (local ranks and one ssh per
// remote host), DeepSpeed's --include/--exclude/--num_nodes/--num_gpus, the node launcher's side
// of --world-info, hostfile errors, and a real two-"host" run through a stand-in ssh that runs
// the remote command on this machine.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>

#include "launcher_process.h"

namespace strata::test {
namespace {

class LauncherHostfile : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir_template[] = "/tmp/strata-hostfile-XXXXXX";
    dir_ = ::mkdtemp(dir_template);
    hostfile_ =
        write("hostfile", "# two hosts\nlocalhost slots=2\n\notherhost slots=2  # remote\n");
    port_ = std::to_string(free_port());
    cwd_ = typed_cwd();
    // The head forwards its NCCL_* and STRATA_* to remote hosts; the expected lines assume none.
    for (char** e = environ; *e; ++e) {
      const std::string var = *e, name = var.substr(0, var.find('='));
      if (name.rfind("NCCL_", 0) == 0 || name.rfind("STRATA_", 0) == 0)
        quiet_env_.emplace_back(name, std::nullopt);
    }
    ASSERT_EQ(cwd_.find_first_not_of(
                  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-"),
              std::string::npos)
        << "the expected ssh lines below assume a plain directory name";
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  Finished dry_run(std::vector<std::string> args) {
    args.insert(args.begin(), {"--dry-run", "--hostfile", hostfile_});
    args.insert(args.end(), {"--", "/bin/echo", "hi"});
    EnvChanges env = quiet_env_;
    env.emplace_back("CUDA_VISIBLE_DEVICES", std::nullopt);
    return run_launcher(args, env);
  }

  std::string rank(int rank, int world, int local, int local_world, int node, int nodes,
                   const std::string& addr, const std::string& port, int device) {
    return "RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) +
           " LOCAL_RANK=" + std::to_string(local) +
           " LOCAL_WORLD_SIZE=" + std::to_string(local_world) +
           " GROUP_RANK=" + std::to_string(node) + " NODE_RANK=" + std::to_string(node) +
           " GROUP_WORLD_SIZE=" + std::to_string(nodes) + " MASTER_ADDR=" + addr +
           " MASTER_PORT=" + port + " CUDA_VISIBLE_DEVICES=" + std::to_string(device) +
           " /bin/echo hi\n";
  }

  std::string ssh(const std::string& host, int node, const std::string& world_info,
                  const std::string& addr, const std::string& port,
                  const std::string& exports = "") {
    return "ssh -T -o BatchMode=yes -o ConnectTimeout=10 " + host + " 'exec " +
           launcher_path() + " --env-stdin --chdir " + cwd_ + " --watch-stdin --node-rank " +
           std::to_string(node) +
           " --world-info " + world_info + " --master-addr " + addr + " --master-port " + port +
           " -- /bin/echo hi'" + (exports.empty() ? "" : "  # stdin: " + exports) + "\n";
  }

  std::string dir_, hostfile_, port_, cwd_;
  EnvChanges quiet_env_;
};

TEST_F(LauncherHostfile, LocalRanksRunHereAndEachRemoteHostGetsOneSsh) {
  Finished r = dry_run({"--master-addr", "10.0.0.1", "--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 4, 0, 2, 0, 2, "10.0.0.1", port_, 0) +
                       rank(1, 4, 1, 2, 0, 2, "10.0.0.1", port_, 1) +
                       ssh("otherhost", 1, "localhost:0,1@otherhost:0,1", "10.0.0.1", port_));
}

TEST_F(LauncherHostfile, IncludeSelectsHostsAndSlots) {
  Finished r = dry_run({"--include", "localhost:1@otherhost:0", "--master-addr", "10.0.0.1",
                        "--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 2, 0, 1, 0, 2, "10.0.0.1", port_, 1) +
                       ssh("otherhost", 1, "localhost:1@otherhost:0", "10.0.0.1", port_));

  r = dry_run({"-i", "otherhost", "--master-port", port_});  // all remote: master is that host
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, ssh("otherhost", 0, "otherhost:0,1", "otherhost", port_));
}

TEST_F(LauncherHostfile, ExcludeRemovesSlotsOrWholeHosts) {
  Finished r = dry_run({"--exclude", "localhost:0@otherhost:1", "--master-addr", "10.0.0.1",
                        "--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 2, 0, 1, 0, 2, "10.0.0.1", port_, 1) +
                       ssh("otherhost", 1, "localhost:1@otherhost:0", "10.0.0.1", port_));

  r = dry_run({"-e", "otherhost", "--master-port", port_});  // all local: no ssh, loopback master
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 2, 0, 2, 0, 1, "127.0.0.1", port_, 0) +
                       rank(1, 2, 1, 2, 0, 1, "127.0.0.1", port_, 1));
}

TEST_F(LauncherHostfile, NumNodesAndNumGpusCutTheHostfile) {
  Finished r = dry_run({"--num_nodes", "1", "--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 2, 0, 2, 0, 1, "127.0.0.1", port_, 0) +
                       rank(1, 2, 1, 2, 0, 1, "127.0.0.1", port_, 1));

  r = dry_run({"--num_gpus", "1", "--master-addr", "10.0.0.1", "--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 2, 0, 1, 0, 2, "10.0.0.1", port_, 0) +
                       ssh("otherhost", 1, "localhost:0@otherhost:0", "10.0.0.1", port_));
}

TEST_F(LauncherHostfile, DefaultMasterIsNodeZeroReachableFromTheOthers) {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  Finished r = dry_run({"--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" MASTER_ADDR=" + std::string(name) + " "), std::string::npos) << r.out;

  hostfile_ = write("remote-first", "otherhost slots=1\nlocalhost slots=1\n");
  r = dry_run({});  // the master is remote: the default port, not checked here
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(1, 2, 0, 1, 1, 2, "otherhost", "29500", 0) +
                       ssh("otherhost", 0, "otherhost:0@localhost:0", "otherhost", "29500"));
}

// Exported variables travel on ssh's stdin (issue 35): the command line, which `ps` shows on
// both hosts, has none of them; --dry-run lists them after the ssh line.
TEST_F(LauncherHostfile, ExportsTravelOnStdinNotOnTheCommandLine) {
  EnvChanges env = quiet_env_;
  env.insert(env.end(), {{"STRATA_T_A", "it's"}, {"SECRET_TOKEN", "hidden"}});
  Finished r = run_launcher(
      {"--dry-run", "--hostfile", hostfile_, "--include", "otherhost", "--master-port", port_,
       "--export", "NCCL_DEBUG=INFO", "--export", "STRATA_T_*", "--", "/bin/echo", "hi"},
      env);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, ssh("otherhost", 0, "otherhost:0,1", "otherhost", port_,
                       "NCCL_DEBUG=INFO STRATA_T_A='it'\\''s'"));
  EXPECT_EQ(r.out.find("hidden"), std::string::npos);
}

// USER@HOST and IPv6 hosts (issue #17): ssh gets the host as written, the world info names
// machines only, and the node launcher at the other end takes that world info.
TEST_F(LauncherHostfile, UserAtHostAndIpv6HostsReachTheNodeLauncherIntact) {
  hostfile_ = write("users", "[::1] slots=1\nalice@otherhost slots=2\n");
  Finished r = dry_run({"--master-addr", "10.0.0.1", "--master-port", port_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(0, 3, 0, 1, 0, 2, "10.0.0.1", port_, 0) +
                       ssh("alice@otherhost", 1, "'\\''[::1]:0@otherhost:0,1'\\''", "10.0.0.1",
                           port_));
  r = run_launcher({"--dry-run", "--node-rank", "1", "--world-info", "[::1]:0@otherhost:0,1",
                    "--master-addr", "10.0.0.1", "--master-port", port_, "--", "/bin/echo", "hi"},
                   {{"CUDA_VISIBLE_DEVICES", std::nullopt}});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(1, 3, 0, 2, 1, 2, "10.0.0.1", port_, 0) +
                       rank(2, 3, 1, 2, 1, 2, "10.0.0.1", port_, 1));
}

// The remote end: what the node launcher started by the ssh line above runs on its host.
TEST_F(LauncherHostfile, NodeLauncherStartsItsShareOfTheWorld) {
  Finished r =
      run_launcher({"--dry-run", "--node-rank", "1", "--world-info", "localhost:1@otherhost:0,1",
                    "--master-addr", "10.0.0.1", "--master-port", port_, "--", "/bin/echo", "hi"},
                   {{"CUDA_VISIBLE_DEVICES", std::nullopt}});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, rank(1, 3, 0, 2, 1, 2, "10.0.0.1", port_, 0) +
                       rank(2, 3, 1, 2, 1, 2, "10.0.0.1", port_, 1));
}

TEST_F(LauncherHostfile, MalformedLineIsAnErrorNamingTheLine) {
  hostfile_ = write("bad", "localhost slots=2\n# fine\nworker-1 slots=two\n");
  Finished r = dry_run({});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("line 3: 'slots=two' is not slots=N in 'worker-1 slots=two'"),
            std::string::npos)
      << r.err;

  hostfile_ = write("dup", "a slots=1\nb slots=1\na slots=2\n");
  r = dry_run({});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("line 3: host 'a' is listed twice"), std::string::npos) << r.err;
}

TEST_F(LauncherHostfile, BadFiltersAreErrorsNamingTheirPart) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--include", "nohost"}, "--include names host 'nohost', which is not in the hostfile"},
           {{"--include", "otherhost:5"}, "--include names slot 5 on host 'otherhost'"},
           {{"--exclude", "localhost:x"}, "slot 'x' of host 'localhost' is not a number"},
           {{"--include", "localhost@"}, "bad node ''"},
           {{"--include", "localhost", "--exclude", "otherhost"}, "mutually exclusive"},
           {{"--include", "localhost", "--num_gpus", "1"}, "cannot be combined"},
           {{"--exclude", "localhost@otherhost"}, "leaves no slots"},
       }) {
    Finished r = dry_run(c.args);
    EXPECT_EQ(r.code, 1) << c.args[0] << " " << c.args[1];
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
  }
}

// A stand-in ssh that runs the remote command on this machine, so the fan-out runs for real.
class LauncherFakeSsh : public LauncherHostfile {
 protected:
  void SetUp() override {
    LauncherHostfile::SetUp();
    ::mkdir((dir_ + "/bin").c_str(), 0755);
    const std::string ssh =
        write("bin/ssh",
              "#!/bin/bash\n"
              "while [ \"${1#-}\" != \"$1\" ]; do [ \"$1\" = -o ] && shift; shift; done\n"
              "shift  # the host\n"
              "exec bash -c \"$1\"\n");
    ::chmod(ssh.c_str(), 0755);
    env_ = {{"PATH", dir_ + "/bin:" + std::getenv("PATH")}, {"CUDA_VISIBLE_DEVICES", std::nullopt}};
  }
  std::vector<std::string> head(const std::string& script) {
    return {"--hostfile", hostfile_, "--master-addr", "127.0.0.1", "--", "bash", "-c", script};
  }
  EnvChanges env_;
};

TEST_F(LauncherFakeSsh, RemoteRanksRunThroughTheNodeLauncher) {
  Finished r = run_launcher(head("echo $RANK/$WORLD_SIZE local=$LOCAL_RANK node=$NODE_RANK "
                                 "gpu=$CUDA_VISIBLE_DEVICES port=$MASTER_PORT"),
                            env_);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string port =
      r.out.substr(r.out.find("port=") + 5, r.out.find('\n') - r.out.find("port=") - 5);
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(
        r.out.find("[rank " + std::to_string(rank) + "] " + std::to_string(rank) +
                   "/4 local=" + std::to_string(rank % 2) + " node=" + std::to_string(rank / 2) +
                   " gpu=" + std::to_string(rank % 2) + " port=" + port + "\n"),
        std::string::npos)
        << r.out;
}

TEST_F(LauncherFakeSsh, RemoteFailureStopsLocalRanks) {
  const std::string marker = unique_sleep(7);
  Finished r = run_launcher(head("test $RANK = 3 && exit 7; sleep " + marker), env_);
  EXPECT_EQ(r.code, 7) << r.err;
  EXPECT_LT(r.seconds, 15);
  EXPECT_NE(r.err.find("node 1 (otherhost) exited with code 7"), std::string::npos) << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

// Ctrl-C reaches the remote ranks as SIGINT too (the head's "stop 2" line through ssh's stdin),
// and only the head says that it stopped them.
TEST_F(LauncherFakeSsh, SigintReachesRemoteRanksAsSigintThroughSshStdin) {
  const std::string marker = unique_sleep(8);
  // Short sleeps: bash runs its trap only once its foreground child has ended, and a SIGINT that
  // comes while it starts one can be lost to that child. The marker names the ranks' shells.
  LauncherProcess launcher(
      head("trap 'echo got-INT; exit 0' INT; echo ready; while :; do sleep 0.1; done # " + marker),
      env_);
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 4, 10));
  launcher.signal(SIGINT);
  Finished r = launcher.wait(15);
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_LT(r.seconds, 10);
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.out.find("[rank " + std::to_string(rank) + "] got-INT"), std::string::npos)
        << r.out;
  EXPECT_NE(r.err.find("strata-run: got Interrupt; forwarding it to every rank"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("strata-run ("), std::string::npos) << r.err;  // nothing from node 1
  EXPECT_EQ(count_processes(marker), 0);
}

LaunchSetup stdin_pipe() {
  LaunchSetup setup;
  setup.stdin_pipe = true;
  return setup;
}

// The grace period is the same on every host: a remote rank that ignores the stop is killed by
// its node launcher after --grace, and the head does not wait longer for it.
TEST_F(LauncherFakeSsh, RemoteRanksIgnoringTheStopAreKilledAfterTheSameGrace) {
  const std::string marker = unique_sleep(10);
  LauncherProcess launcher({"--grace", "1", "--hostfile", hostfile_, "--master-addr", "127.0.0.1",
                            "--", "bash", "-c", "trap '' TERM; echo ready; sleep " + marker},
                           env_);
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 4, 10));
  launcher.signal(SIGTERM);
  Finished r = launcher.wait(15);
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.err;
  EXPECT_LT(r.seconds, 3.5) << r.err;  // the head alone would kill ssh at 1 + 3 s
  EXPECT_NE(r.err.find("strata-run: rank 0 still running 1 s after the stop signal"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("strata-run (node 1, otherhost): rank 2 still running 1 s after the stop "
                       "signal"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("killing ssh"), std::string::npos) << r.err;
  EXPECT_EQ(wait_for_count(marker, 0, 5), 0);
}

// The remote side says which folder it could not enter, naming its node.
TEST_F(LauncherHostfile, NodeLauncherNamesAWorkingFolderItCannotEnter) {
  Finished r = run_launcher({"--chdir", dir_ + "/no-such-folder", "--node-rank", "1",
                             "--world-info", "localhost:0@otherhost:0", "--master-addr",
                             "127.0.0.1", "--master-port", port_, "--", "true"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("strata-run (node 1, otherhost): error: cannot enter the working folder '" +
                       dir_ + "/no-such-folder' here: No such file or directory"),
            std::string::npos)
      << r.err;
}

// A node launcher whose stdin closes without a stop line (the head or the link is gone) stops
// its ranks with SIGTERM and says so, naming its node.
TEST_F(LauncherHostfile, NodeLauncherStopsItsRanksWhenTheHeadIsGone) {
  const std::string marker = unique_sleep(9);
  LauncherProcess launcher({"--watch-stdin", "--node-rank", "1", "--world-info",
                            "localhost:0@otherhost:0", "--master-addr", "127.0.0.1",
                            "--master-port", port_, "--", "bash", "-c",
                            "echo ready; sleep " + marker},
                           quiet_env_, stdin_pipe());
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 1, 10));
  launcher.close_stdin();
  Finished r = launcher.wait(10);
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.err;
  EXPECT_NE(r.err.find("strata-run (node 1, otherhost): stdin closed without a stop"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_processes(marker), 0);
}

}  // namespace
}  // namespace strata::test
