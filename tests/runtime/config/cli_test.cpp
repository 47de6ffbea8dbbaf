// The real strata-config binary: exit codes 0 / 1 / 2 and nothing else, whatever the file.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "tests/runtime/config/config_test_util.h"

namespace strata::test {
namespace {

namespace fs = std::filesystem;

struct Result {
  int code = -1;
  std::string out, err;
};

class ConfigCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name, const std::string& content) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }

  Result run(const std::string& args) {
    const std::string out = (dir_ / "stdout").string(), err = (dir_ / "stderr").string();
    const std::string cmd = std::string(STRATA_BIN_DIR) + "/strata-config " + args + " >" + out + " 2>" + err;
    const int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  fs::path dir_;
};

TEST_F(ConfigCli, ValidConfigExits0AndPrintsTheResolvedConfig) {
  const Result r = run("check " + repo_path("configs/gpt_tiny.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  const json printed = json::parse(r.out);
  EXPECT_EQ(printed.at("train_batch_size"), 8);
  EXPECT_EQ(printed.at("optimizer").at("type"), "adamw");
  EXPECT_EQ(printed.at("optimizer").at("params").at("eps"), 1e-8);  // defaults included
  EXPECT_TRUE(printed.at("zero_optimization").contains("stage3_max_reuse_distance"));
  EXPECT_CONTAINS(r.err, "valid");
}

TEST_F(ConfigCli, WarningsGoToStderr) {
  // ZeRO-Infinity's config runs whole: nothing is pending.
  Result r = run("check " + repo_path("configs/zero3_offload_nvme.json"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("not run it yet"), std::string::npos) << r.err;
  r = run("check " + file("warn.json", R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "fast_init": true}}})"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "warning:");
  EXPECT_CONTAINS(r.err, "zero_optimization.offload_optimizer.fast_init = true is accepted but has no effect");
}

TEST_F(ConfigCli, InvalidConfigExits1WithTheProblemsOnStderr) {
  const Result r = run("check " + file("bad.json", R"({"train_batch_size": 8, "zero_optimization": {"stage": 9}})"));
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "zero_optimization.stage = 9 is out of range");
  EXPECT_CONTAINS(r.err, "bad.json:1:");
  EXPECT_TRUE(r.out.empty());
}

TEST_F(ConfigCli, HostileFilesExit1) {
  std::mt19937 rng(11);
  std::string garbage(1 << 16, '\0');
  for (char& c : garbage) c = static_cast<char>(rng());
  std::string deep;
  for (int i = 0; i < 200000; ++i) deep += "{\"a\":";
  const std::pair<const char*, std::string> cases[] = {
      {"empty.json", ""},
      {"garbage.bin", garbage},
      {"brackets.json", std::string(10 << 20, '[')},
      {"deep.json", deep},
      {"nan.json", R"({"train_batch_size": NaN})"},
      {"huge.json", R"({"train_batch_size": 1e400})"},
      {"dup.json", R"({"train_batch_size": 8, "train_batch_size": 8})"},
      {"array.json", "[]"},
  };
  for (const auto& [name, content] : cases) {
    const Result r = run("check " + file(name, content));
    EXPECT_EQ(r.code, 1) << name << ": " << r.err.substr(0, 500);
    EXPECT_CONTAINS(r.err, "error:");
  }
}

TEST_F(ConfigCli, MissingFileAndDirectoryExit1) {
  const Result missing = run("check " + (dir_ / "nope.json").string());
  EXPECT_EQ(missing.code, 1);
  EXPECT_CONTAINS(missing.err, "no such file");
  const Result directory = run("check " + dir_.string());
  EXPECT_EQ(directory.code, 1);
  EXPECT_CONTAINS(directory.err, "is a directory");
}

TEST_F(ConfigCli, BadCommandLinesExit2) {
  const std::string ok = repo_path("configs/gpt_tiny.json");
  for (const std::string& args : {std::string(""), std::string("frobnicate"), std::string("check"),
                                  "check " + ok + " --world-size", "check " + ok + " --world-size 0",
                                  "check " + ok + " --world-size x", "check " + ok + " --bogus",
                                  "check " + ok + " " + ok}) {
    const Result r = run(args);
    EXPECT_EQ(r.code, 2) << "args: " << args << "\n" << r.err;
    EXPECT_CONTAINS(r.err, "usage:");
  }
}

TEST_F(ConfigCli, HelpExits0) {
  const Result r = run("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_CONTAINS(r.out, "strata-config check FILE");
  EXPECT_CONTAINS(r.out, "--world-size");
}

TEST_F(ConfigCli, WorldSizeOptionFeedsTheBatchTriangle) {
  const std::string f = file("ws.json", R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                            "gradient_accumulation_steps": 2})");
  EXPECT_EQ(run("check " + f).code, 1);
  EXPECT_EQ(run("check " + f + " --world-size 4").code, 0);
}

TEST_F(ConfigCli, AllowOptimizerRegistersAType) {
  const std::string f = file("opt.json", R"({"train_batch_size": 8, "optimizer": {"type": "Adafactor"}})");
  const Result plain = run("check " + f);
  EXPECT_EQ(plain.code, 0);  // check mode: an unregistered, far-from-known type is a warning
  EXPECT_CONTAINS(plain.err, "must register it");
  const Result allowed = run("check " + f + " --allow-optimizer Adafactor");
  EXPECT_EQ(allowed.code, 0);
  EXPECT_EQ(allowed.err.find("must register"), std::string::npos);
}

}  // namespace
}  // namespace strata::test
