// strata-run --config FILE: the `launcher` block read through the config schema, flags winning
// over it, the config passed on to the program, and the whole config checked for the planned
// world before any rank starts.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <set>

#include "launcher_process.h"

namespace strata::test {
namespace {

std::string write_config(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

const char* kEcho = "echo \"R=$RANK W=$WORLD_SIZE FOO=$FOO ARGS=$*\"";

TEST(LauncherConfig, BlockChoosesRanksAndEnvironmentAndTheProgramGetsTheConfig) {
  const auto path = write_config("launch_ok.json", R"({
    "train_batch_size": 6, "train_micro_batch_size_per_gpu": 2,
    "launcher": {"num_gpus": 3, "export": ["FOO=bar"]}})");
  Finished r = run_launcher({"--config", path, "--", "bash", "-c", kEcho, "prog"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::set<std::string> ranks;
  std::smatch m;
  const std::regex line(R"(\[rank (\d)\] R=(\d) W=3 FOO=bar ARGS=--config (\S+))");
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), line);
       it != std::sregex_iterator(); ++it) {
    EXPECT_EQ((*it)[1], (*it)[2]);
    EXPECT_NE((*it)[3].str().find("launch_ok.json"), std::string::npos);
    ranks.insert((*it)[1]);
  }
  EXPECT_EQ(ranks.size(), 3u) << r.out;
}

TEST(LauncherConfig, CommandLineFlagsWinOverTheBlock) {
  const auto path = write_config("launch_override.json", R"({
    "train_micro_batch_size_per_gpu": 2, "launcher": {"num_gpus": 3}})");
  Finished r = run_launcher({"--config", path, "--num_gpus", "2", "--", "bash", "-c", kEcho, "p"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("W=2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("W=3"), std::string::npos) << r.out;
}

// Issue #17: --include on the command line replaces the block's choice of slots (num_gpus
// included), and a relative launcher.hostfile is read from the config's folder.
TEST(LauncherConfig, IncludeFlagWinsOverNumGpusAndTheHostfileIsTheConfigsNeighbour) {
  const std::string dir = testing::TempDir() + "/launch_hostfile_" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  std::ofstream(dir + "/hosts") << "localhost slots=4\n";
  const auto path = write_config("launch_hostfile_" + std::to_string(::getpid()) + "/c.json", R"({
    "train_micro_batch_size_per_gpu": 2, "launcher": {"hostfile": "hosts", "num_gpus": 3}})");
  Finished r = run_launcher(
      {"--config", path, "--include", "localhost:1,3", "--", "bash", "-c", kEcho, "p"});
  ASSERT_EQ(r.code, 0) << r.err;  // run from the test's folder, not the config's
  EXPECT_NE(r.out.find("W=2"), std::string::npos) << r.out;

  const auto missing = write_config("launch_nohosts.json", R"({
    "train_micro_batch_size_per_gpu": 2, "launcher": {"hostfile": "no-such-hosts"}})");
  r = run_launcher({"--config", missing, "--", "true"});
  EXPECT_EQ(r.code, 1);
  const std::string folder = testing::TempDir();  // the config's, not the current one
  EXPECT_NE(r.err.find("cannot read hostfile '" + folder), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("/no-such-hosts' (launcher.hostfile 'no-such-hosts' of "), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("launch_nohosts.json, read relative to the config's folder): No such file "
                       "or directory"),
            std::string::npos)
      << r.err;
}

TEST(LauncherConfig, BatchTriangleIsCheckedForThePlannedWorldBeforeAnyRankStarts) {
  // 8 = 2 x gas x 3 has no whole solution for gas.
  const auto path = write_config("launch_triangle.json", R"({
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "launcher": {"num_gpus": 3}})");
  Finished r = run_launcher({"--config", path, "--", "bash", "-c", "echo started"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("train_batch_size"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("started"), std::string::npos) << r.out;
}

TEST(LauncherConfig, BlockIsValidatedLikeEveryOther) {
  const auto path = write_config("launch_typo.json", R"({
    "train_micro_batch_size_per_gpu": 2, "launcher": {"hostfle": "/etc/hosts"}})");
  Finished r = run_launcher({"--config", path, "--", "true"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("launcher.hostfle"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("hostfile"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strata::test
