// strata-run over real ssh (issue #17): each test starts its own OpenSSH server on loopback
// addresses (127.0.0.2 and 127.0.0.3 stand for two hosts), with host aliases in a private ssh
// config (passed with --ssh-config; the user's ~/.ssh is not touched), key login with a key made
// here, and "RequestTTY force" as a user's config may have it. openssh-server is installed when
// missing (apt-get, as root or through sudo -n, as CI can); a test skips, saying why, only where
// no sshd can be started.
//
// train_gpt across the two "hosts" without --master-addr gives the losses of the same job under
// --nproc-per-node; so do USER@alias hosts and binaries reached through a symlinked build folder.
// A host that accepts TCP and never speaks ssh ends the job within the connect timeout + 15 s,
// naming it; refused and unauthorised logins, a missing remote launcher and an unresolvable
// master are told apart by name; Ctrl-C reaches remote ranks as SIGINT, quietly; remote ranks get
// the head's STRATA_*/NCCL_* and .strata_env.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "launcher_process.h"

namespace strata::test {
namespace {

const char* kSshd = "/usr/sbin/sshd";
const std::string kBin = STRATA_BIN_DIR;
const std::string kTrainGpt = kBin + "/train_gpt";

int sh(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string user_name() {
  const passwd* pw = ::getpwuid(::geteuid());
  return pw ? pw->pw_name : "root";
}

// "" once /usr/sbin/sshd exists, else why it could not be installed.
std::string ensure_sshd(const std::string& log) {
  if (::access(kSshd, X_OK) == 0) return "";
  if (sh("command -v apt-get >/dev/null") != 0)
    return "no /usr/sbin/sshd, and no apt-get to install openssh-server";
  const std::string sudo = ::geteuid() == 0 ? "" : "sudo -n ";
  const std::string install = sudo +
                              "env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                              "--no-install-recommends openssh-server";
  // One installer at a time (CTest runs these tests in parallel); the package lists are
  // refreshed only when the first try fails.
  sh("flock /tmp/strata-test-openssh.lock sh -c '" + install + " || { " + sudo +
     "apt-get update -qq && " + install + "; }' >" + log + " 2>&1");
  if (::access(kSshd, X_OK) == 0) return "";
  return "openssh-server is not installed and could not be (" + sudo + "apt-get): " +
         read_file(log);
}

// Waits until something accepts TCP connections on address:port.
bool wait_listening(const std::string& address, int port, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, address.c_str(), &to.sin_addr);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// A listening socket on 127.0.0.4 that never accepts: the kernel completes the TCP handshake and
// the client then waits for an ssh banner that never comes.
struct SilentHost {
  int fd = -1, port = 0;
  SilentHost() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.4", &at.sin_addr);
    socklen_t length = sizeof at;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0 && ::listen(fd, 16) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length) == 0)
      port = ntohs(at.sin_port);
  }
  ~SilentHost() { ::close(fd); }
};

class SshHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir_template[] = "/tmp/strata-ssh-XXXXXX";
    dir_ = ::mkdtemp(dir_template);
    if (const std::string why = ensure_sshd(dir_ + "/apt.log"); !why.empty())
      GTEST_SKIP() << "no sshd to test with: " << why;
    if (::access("/run/sshd", F_OK) != 0)  // sshd's privilege separation folder (root only)
      sh(std::string(::geteuid() == 0 ? "" : "sudo -n ") +
         "mkdir -p -m 0755 /run/sshd 2>/dev/null");
    ASSERT_EQ(sh("ssh-keygen -q -t ed25519 -N '' -f " + dir_ + "/host_key && ssh-keygen -q -t "
                 "ed25519 -N '' -f " + dir_ + "/user_key && cp " + dir_ + "/user_key.pub " +
                 dir_ + "/authorized_keys"),
              0);
    refused_port_ = free_port();
    ssh_config_ = dir_ + "/ssh_config";
    // sshd as this user logs in only this user; as root (sudo) any. Without PAM, sshd refuses an
    // account whose password field says locked ('!', as useradd leaves it); with PAM, a
    // container may refuse the session (pam_loginuid). So each way is tried until one logs in.
    std::string failures;
    for (const bool as_root : {false, true}) {
      if (as_root && (::geteuid() == 0 || sh("sudo -n true 2>/dev/null") != 0)) continue;
      for (const bool pam : {false, true}) {
        const std::string why = start_sshd(as_root, pam);
        if (why.empty()) return;
        failures += "\n- sshd" + std::string(as_root ? " through sudo" : "") +
                    (pam ? " with PAM: " : " without PAM: ") + why;
      }
    }
    GTEST_SKIP() << "no sshd to test with could be started here:" << failures;
  }

  // Starts sshd on 127.0.0.2 and 127.0.0.3 and logs in once: "" on success, else why not.
  std::string start_sshd(bool as_root, bool pam) {
    port_ = free_port();
    std::ofstream(dir_ + "/sshd_config")
        << "ListenAddress 127.0.0.2:" << port_ << "\nListenAddress 127.0.0.3:" << port_
        << "\nHostKey " << dir_ << "/host_key\nAuthorizedKeysFile " << dir_
        << "/authorized_keys\nPidFile " << dir_ << "/sshd.pid\nUsePAM " << (pam ? "yes" : "no")
        << "\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
           "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nStrictModes no\n"
           "MaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n";
    sudo_ = as_root ? "sudo -n " : "";
    const std::string log = dir_ + "/sshd.log";
    if (sh(sudo_ + kSshd + " -f " + dir_ + "/sshd_config -E " + log) != 0 ||
        !wait_listening("127.0.0.2", port_, 10))
      return "it did not start: " + read_file(log);
    started_ = true;
    std::ofstream(ssh_config_)
        << "Host alias-a\n  HostName 127.0.0.2\n"
        << "Host alias-b\n  HostName 127.0.0.3\n"
        << "Host silent\n  HostName 127.0.0.4\n  Port " << silent_.port << "\n"
        << "Host refused\n  HostName 127.0.0.2\n  Port " << refused_port_ << "\n"
        << "Host stranger\n  HostName 127.0.0.2\n  User strata-no-such-user\n"
        << "Host *\n  Port " << port_ << "\n  User " << user_name() << "\n  IdentityFile "
        << dir_ << "/user_key\n  IdentitiesOnly yes\n  UserKnownHostsFile " << dir_
        << "/known_hosts\n  StrictHostKeyChecking no\n  LogLevel ERROR\n"
        << "  RequestTTY force\n";  // as a user's config may say: strata-run's -T wins
    const std::string check = dir_ + "/check.log";
    if (sh("ssh -F " + ssh_config_ + " -o BatchMode=yes -T alias-b true >" + check + " 2>&1") == 0)
      return "";
    stop_sshd();
    return "key login failed: " + read_file(check) + read_file(log);
  }

  void stop_sshd() {
    if (!started_) return;
    const pid_t sshd = std::atoi(read_file(dir_ + "/sshd.pid").c_str());
    if (sshd > 0) sh(sudo_ + "kill " + std::to_string(sshd));
    ::unlink((dir_ + "/sshd.pid").c_str());
    started_ = false;
  }

  void TearDown() override {
    stop_sshd();
    sh("rm -rf " + dir_);
  }

  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  // The head's arguments for a hostfile job through the test's ssh config. The master port is
  // free here: with node 0 remote the default is 29500, which tests running at once would share.
  std::vector<std::string> over_ssh(const std::string& hostfile_text,
                                    std::vector<std::string> program,
                                    std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--ssh-config", ssh_config_, "--hostfile",
                                     write("hostfile", hostfile_text), "--master-port",
                                     std::to_string(free_port())};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back("--");
    args.insert(args.end(), program.begin(), program.end());
    return args;
  }

  // train_gpt's tiny model for a few steps on 2 ranks, one thread each so that the two runs
  // do the same arithmetic; its losses land in `metrics`.
  std::vector<std::string> train_gpt(const std::string& binary, const std::string& metrics) {
    return {binary, "--device", "cpu", "--model", "tiny", "--config",
            std::string(STRATA_SOURCE_DIR) + "/configs/gpt_tiny_dp.json", "--steps", "10",
            "--seed", "3", "--metrics-jsonl", metrics};
  }

  // The same job under --nproc-per-node 2 on this machine.
  std::vector<std::string> local_losses() {
    const std::string metrics = dir_ + "/local.jsonl";
    std::vector<std::string> args = {"--nproc-per-node", "2", "--"};
    for (std::string& a : train_gpt(kTrainGpt, metrics)) args.push_back(std::move(a));
    Finished r = run_launcher(args, {{"OMP_NUM_THREADS", "1"}}, 300);
    EXPECT_EQ(r.code, 0) << r.out << r.err;
    return metrics_losses(metrics);
  }

  void expect_same_losses_as_local(const std::string& hostfile_text, const LaunchSetup& setup,
                                   const std::string& binary = kTrainGpt) {
    if (::access(kTrainGpt.c_str(), X_OK) != 0) FAIL() << kTrainGpt << " is not built";
    const std::vector<std::string> reference = local_losses();
    ASSERT_EQ(reference.size(), 10u);
    const std::string metrics = dir_ + "/ssh.jsonl";
    // The local ranks inherit this environment; the remote ones get a login's, so whatever
    // here chooses the BLAS kernels travels with them: OPENBLAS_CORETYPE (a CI machine may pin
    // Haswell on an AVX-512 CPU) changes the matrix products' rounding.
    LauncherProcess launcher(
        over_ssh(hostfile_text, train_gpt(binary, metrics),
                 {"--export", "OMP_NUM_THREADS=1", "--export", "OPENBLAS_*"}),
        {{"OMP_NUM_THREADS", "1"}}, setup);
    Finished r = launcher.wait(300);
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("[rank 0] "), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find('\r'), std::string::npos) << "a remote tty: " << r.out;
    EXPECT_EQ(r.err.find('\r'), std::string::npos) << r.err;
    EXPECT_EQ(metrics_losses(metrics), reference) << r.out << r.err;
  }

  std::string dir_, ssh_config_, sudo_;
  int port_ = 0, refused_port_ = 0;
  bool started_ = false;
  SilentHost silent_;
};

TEST_F(SshHosts, TrainGptOnTwoAliasesWithoutMasterAddrGivesTheLocalLosses) {
  // The master is what ssh connects to for node 0 (the alias's HostName), not the alias.
  Finished dry = run_launcher(over_ssh("alias-a slots=1\nalias-b slots=1\n", {"true"},
                                       {"--dry-run", "--master-port", "29999"}));
  ASSERT_EQ(dry.code, 0) << dry.err;
  EXPECT_NE(dry.out.find("ssh -T -o BatchMode=yes -o ConnectTimeout=10 -F " + ssh_config_ +
                         " alias-a '"),
            std::string::npos)
      << dry.out;
  EXPECT_NE(dry.out.find("--master-addr 127.0.0.2 --master-port 29999"), std::string::npos)
      << dry.out;
  expect_same_losses_as_local("alias-a slots=1\nalias-b slots=1\n", {});
}

// A node 0 that ssh reaches on a loopback address is this machine: a node elsewhere could not
// reach it as the master, which fails before anything starts. With node 0 here, the master is
// this machine's address towards the other hosts.
TEST_F(SshHosts, DefaultMasterIsCheckedAgainstWhereTheOtherHostsAre) {
  std::ofstream(ssh_config_, std::ios::app) << "Host far\n  HostName 192.0.2.1\n";  // TEST-NET-1
  Finished r = run_launcher(over_ssh("alias-a slots=1\nfar slots=1\n", {"true"}, {"--dry-run"}));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find("node 0 ('alias-a') is 127.0.0.2 through ssh, a loopback address that "
                       "node 1 ('far', 192.0.2.1) cannot reach"),
            std::string::npos)
      << r.err;

  r = run_launcher(over_ssh("localhost slots=1\nalias-b slots=1\n", {"true"},
                            {"--dry-run", "--master-port", "29999"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" MASTER_ADDR=127.0.0.1 "), std::string::npos) << r.out;
}

// DeepSpeed's --ssh_port wins over the ssh config's Port.
TEST_F(SshHosts, SshPortOptionReachesTheServer) {
  Finished r = run_launcher(over_ssh("refused slots=1\n", {"echo", "in"},
                                     {"--ssh_port", std::to_string(port_)}));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank 0] in\n");
}

TEST_F(SshHosts, UserAtAliasHostsGiveTheLocalLosses) {
  const std::string user = user_name();
  expect_same_losses_as_local(user + "@alias-a slots=1\n" + user + "@alias-b slots=1\n", {});
}

// strata-run and train_gpt reached through a symlinked build folder, from a symlinked working
// folder: the remote side gets the paths as typed, not the resolved ones.
TEST_F(SshHosts, BinariesThroughASymlinkedBuildFolderGiveTheLocalLosses) {
  ASSERT_EQ(::symlink(kBin.c_str(), (dir_ + "/build").c_str()), 0);
  ASSERT_EQ(::mkdir((dir_ + "/real-work").c_str(), 0755), 0);
  ASSERT_EQ(::symlink((dir_ + "/real-work").c_str(), (dir_ + "/work").c_str()), 0);
  LaunchSetup setup;
  setup.launcher = dir_ + "/build/strata-run";
  setup.directory = dir_ + "/work";
  const std::string hosts = "alias-a slots=1\nalias-b slots=1\n";
  LauncherProcess dry(over_ssh(hosts, {"true"}, {"--dry-run"}), {}, setup);
  Finished r = dry.wait(20);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("exec " + dir_ + "/build/strata-run --env-stdin --chdir " + dir_ +
                       "/work "),
            std::string::npos)
      << r.out;
  expect_same_losses_as_local(hosts, setup, dir_ + "/build/train_gpt");
}

// The must-show case: a host that accepts TCP and never speaks ssh.
TEST_F(SshHosts, SilentHostEndsTheJobWithinTheConnectTimeoutNamingIt) {
  ASSERT_GT(silent_.port, 0);
  const std::string marker = unique_sleep(21);
  const int timeout = 3;
  Finished r = run_launcher(over_ssh("alias-a slots=1\nsilent slots=1\n", {"sleep", marker},
                                     {"--ssh-connect-timeout", std::to_string(timeout)}),
                            {}, 60);
  std::printf("silent host: the job ended after %.1f s (connect timeout %d s)\n", r.seconds,
              timeout);
  EXPECT_EQ(r.code, 255) << r.err;
  EXPECT_LT(r.seconds, timeout + 15);
  EXPECT_GE(r.seconds, timeout - 0.5);
  EXPECT_NE(r.err.find("strata-run: node 1 (silent) exited with code 255: ssh to silent did not "
                       "connect within 3 s"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("[ssh silent] "), std::string::npos) << r.err;  // ssh's own words
  EXPECT_EQ(wait_for_count(marker, 0, 10), 0);
}

TEST_F(SshHosts, RefusedConnectionsAndRefusedLoginsAreToldApart) {
  Finished r = run_launcher(over_ssh("refused slots=1\n", {"true"}));
  EXPECT_EQ(r.code, 255) << r.err;
  EXPECT_NE(r.err.find("node 0 (refused) exited with code 255: ssh to refused was refused: "
                       "nothing listens on its ssh port"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("passwordless"), std::string::npos) << r.err;

  r = run_launcher(over_ssh("stranger slots=1\n", {"true"}));
  EXPECT_EQ(r.code, 255) << r.err;
  EXPECT_NE(r.err.find("ssh to stranger could not log in: is passwordless (key) ssh"),
            std::string::npos)
      << r.err;
}

// Ctrl-C: the remote ranks get SIGINT as the local ones would, the job ends well within the
// grace period although the ssh config asks for a tty, and only the head speaks.
TEST_F(SshHosts, CtrlCReachesRemoteRanksAsSigintAndOnlyTheHeadSpeaks) {
  // Short sleeps: bash runs its trap only once its foreground child has ended, and a SIGINT that
  // comes while it starts one can be lost to that child. The marker names the ranks' shells.
  const std::string marker = unique_sleep(22);
  LauncherProcess launcher(over_ssh(
      "alias-a slots=1\nalias-b slots=1\n",
      {"bash", "-c",
       "trap 'echo got-INT; exit 0' INT; echo ready; while :; do sleep 0.1; done # " + marker}));
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 2, 30)) << launcher.out();
  launcher.signal(SIGINT);
  Finished r = launcher.wait(30);
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_LT(r.seconds, 30);
  EXPECT_NE(r.out.find("[rank 0] got-INT\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] got-INT\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "strata-run: got Interrupt; forwarding it to every rank\n");
  EXPECT_EQ(wait_for_count(marker, 0, 10), 0);
}

// The head's STRATA_* and NCCL_* reach remote ranks (their login's environment has neither), so
// do the lines of .strata_env; other variables do not.
TEST_F(SshHosts, RemoteRanksGetTheHeadsStrataAndNcclVariablesAndStrataEnv) {
  ASSERT_EQ(::mkdir((dir_ + "/work").c_str(), 0755), 0);
  write("work/.strata_env", "# as DeepSpeed's .deepspeed_env\nFROM_FILE=a b\n");
  LaunchSetup setup;
  setup.directory = dir_ + "/work";
  LauncherProcess launcher(
      over_ssh("alias-a slots=1\n",
               {"bash", "-c", "echo \"T=$STRATA_TIMEOUT N=$NCCL_DEBUG F=$FROM_FILE S=$SECRET_X\""}),
      {{"STRATA_TIMEOUT", "77"}, {"NCCL_DEBUG", "WARN"}, {"SECRET_X", "hidden"}}, setup);
  Finished r = launcher.wait(30);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank 0] T=77 N=WARN F=a b S=\n");
}

// A hostile .strata_env: a 100 kB name (std::regex overflowed the stack on it) and a FIFO
// (opening it would block the launch) are refused, naming the file, before any rank starts.
TEST_F(SshHosts, HostileStrataEnvIsRefusedByName) {
  ASSERT_EQ(::mkdir((dir_ + "/work").c_str(), 0755), 0);
  write("work/.strata_env", std::string(100000, 'A') + "=1\n");
  LaunchSetup setup;
  setup.directory = dir_ + "/work";
  Finished r = LauncherProcess(over_ssh("alias-a slots=1\n", {"true"}), {}, setup).wait(30);
  EXPECT_EQ(r.code, 1) << r.err.substr(0, 2000);
  EXPECT_NE(r.err.find(".strata_env line 1: expected NAME=VALUE"), std::string::npos)
      << r.err.substr(0, 2000);
  EXPECT_LT(r.err.size(), 2000u);  // the line is cut, not echoed whole
  ASSERT_EQ(::unlink((dir_ + "/work/.strata_env").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir_ + "/work/.strata_env").c_str(), 0600), 0);
  r = LauncherProcess(over_ssh("alias-a slots=1\n", {"true"}), {}, setup).wait(30);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find(".strata_env is not a regular file"), std::string::npos) << r.err;
}

// Issue 35: exported variables, .strata_env lines and the job's secret travel on ssh's stdin, so
// no `ps` on either "host" (both are this machine here, so one `ps -e` sees both sides: the head,
// its ssh clients, the sshd sessions, the node launchers and the ranks) shows any of their
// values while the job runs; the remote ranks still get every one of them.
TEST_F(SshHosts, NoExportedValueIsOnAnyCommandLineWhileTheJobRuns) {
  ASSERT_EQ(::mkdir((dir_ + "/work").c_str(), 0755), 0);
  const std::string from_file = "strata-env-file-value-4a7c", exported = "strata-export-value-9e1d";
  const std::string forwarded = "strata-forwarded-value-c55b";
  const std::string secret = "strata-secret-value-0f3e2d1c0b";
  write("work/.strata_env", "FROM_FILE=" + from_file + "\n");
  LaunchSetup setup;
  setup.directory = dir_ + "/work";
  const std::string marker = unique_sleep(23);
  LauncherProcess launcher(
      over_ssh("alias-a slots=1\nalias-b slots=1\n",
               {"bash", "-c",
                "echo \"got $FROM_FILE $EXPORTED $STRATA_T_FORWARDED $STRATA_JOB_SECRET\"; "
                "echo ready; sleep 30 # " + marker},
               {"--export", "EXPORTED=" + exported}),
      {{"STRATA_T_FORWARDED", forwarded}, {"STRATA_JOB_SECRET", secret}}, setup);
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 2, 60)) << launcher.out();
  const std::string ps = dir_ + "/ps.txt";
  ASSERT_EQ(sh("ps -eww -o pid,args > " + ps), 0);
  const std::string table = read_file(ps);
  EXPECT_NE(table.find("--env-stdin"), std::string::npos) << table;  // the node launchers ran
  for (const std::string& value : {from_file, forwarded, secret})
    EXPECT_EQ(table.find(value), std::string::npos) << value << " in:\n" << table;
  // --export NAME=VALUE is on the head's own command line, as typed; nowhere else.
  size_t seen = 0;
  for (size_t at = table.find(exported); at != std::string::npos;
       at = table.find(exported, at + 1))
    ++seen;
  EXPECT_EQ(seen, 1u) << table;
  std::printf("ps -eww: %zu lines, %zu processes with --env-stdin; no value of .strata_env, "
              "STRATA_*, STRATA_JOB_SECRET; the --export value only on the head's own line\n",
              size_t(std::count(table.begin(), table.end(), '\n')),
              size_t([&] {
                size_t n = 0;
                for (size_t at = table.find("--env-stdin"); at != std::string::npos;
                     at = table.find("--env-stdin", at + 1))
                  ++n;
                return n;
              }()));
  launcher.signal(SIGTERM);
  Finished r = launcher.wait(30);
  const std::string got = "got " + from_file + " " + exported + " " + forwarded + " " + secret;
  EXPECT_NE(r.out.find("[rank 0] " + got), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] " + got), std::string::npos) << r.out;
  EXPECT_EQ(wait_for_count(marker, 0, 10), 0);
}

TEST_F(SshHosts, MissingRemoteLauncherAndUnresolvableMasterAreNamed) {
  Finished r = run_launcher(over_ssh("alias-a slots=1\n", {"true"}),
                            {{"STRATA_REMOTE_LAUNCHER", "/nonexistent/strata-run"}});
  EXPECT_EQ(r.code, 127) << r.err;
  EXPECT_NE(r.err.find("node 0 (alias-a) exited with code 127: the shell on alias-a cannot run "
                       "/nonexistent/strata-run"),
            std::string::npos)
      << r.err;

  // A master only some machine knows fails before any rank starts, on the node that cannot
  // resolve it, not after STRATA_TIMEOUT.
  r = run_launcher(over_ssh("alias-a slots=1\nalias-b slots=1\n", {"sleep", "30"},
                            {"--master-addr", "strata-no-such-host.invalid"}));
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_LT(r.seconds, 15);
  EXPECT_NE(r.err.find("error: the master address 'strata-no-such-host.invalid' does not "
                       "resolve here"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("strata-run (node "), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strata::test
