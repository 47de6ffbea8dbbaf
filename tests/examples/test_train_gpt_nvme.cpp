// ZeRO-Infinity's optimizer offload (offload_optimizer.device "nvme", stage 3) through the real
// train_gpt: the fp32 master and Adam's moments in swap files under nvme_path (io_uring,
// O_DIRECT, checked pages), stepped in tiles of sub_group_size.
//   - the losses of the same run without offload and with CPU offload, fp32 to 1e-5, on 1 and
//     2 ranks, pipelined and not, with gradient accumulation and clipping;
//   - a checkpoint saved with the state on NVMe on 2 ranks resumes on 1 rank on NVMe and on 1
//     rank at stage 2 in host memory, with the uninterrupted losses;
//   - with offload_param (cpu, nvme) too: the 16-bit shards in host memory or a swap file, read
//     back for every gather, the step's new weights written there: the same losses; and with
//     offload_param alone (the optimizer on the device), saved and resumed at another world size;
//   - the swap folders are gone after a normal exit; a bad nvme_path (missing, a file, on a full
//     or a read-only file system) or an optimizer the swapper cannot step is refused before
//     step 1, by name.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train_gpt_runs.h"
#include "../offload/build_fs_dir.h"
#include "../sanitized.h"

namespace {

using train_gpt_runs::capture;
using train_gpt_runs::read_jsonl;
namespace fs = std::filesystem;

class TrainGptNvme : public strata::test_support::BuildFsDirTest {
 protected:
  TrainGptNvme() : BuildFsDirTest("train-gpt-nvme") {}

  // gpt_tiny_dp at `stage` with the optimizer where `device` says ("none", "cpu", "nvme").
  std::string config(int stage, const std::string& device, bool pipelined = true,
                     const std::string& optimizer = "AdamW", const std::string& params = "none",
                     int micro_batch = 4, const nlohmann::json& patch = nlohmann::json::object()) {
    nlohmann::json c;
    std::ifstream(std::string(STRATA_SOURCE_DIR) + "/configs/gpt_tiny_dp.json") >> c;
    c.erase("launcher");
    c["train_micro_batch_size_per_gpu"] = micro_batch;
    c.erase("gradient_accumulation_steps");
    c["optimizer"]["type"] = optimizer;
    if (optimizer == "SGD") c["optimizer"]["params"] = {{"lr", 0.01}};
    c["zero_optimization"] = {{"stage", stage}, {"reduce_bucket_size", 20000},
                              {"sub_group_size", 7000}, {"stage3_param_persistence_threshold", 0}};
    if (device != "none") {
      c["zero_optimization"]["offload_optimizer"] = {{"device", device}};
      if (device == "nvme")
        c["zero_optimization"]["offload_optimizer"].update(
            {{"nvme_path", (dir_ / "swap").string()}, {"pipeline_read", pipelined},
             {"pipeline_write", pipelined}});
    }
    if (params != "none") {
      c["zero_optimization"]["offload_param"] = {{"device", params}};
      if (params == "nvme") c["zero_optimization"]["offload_param"]["nvme_path"] = (dir_ / "swap").string();
    }
    c["aio"] = {{"block_size", 65536}, {"queue_depth", 4}};
    c.merge_patch(patch);
    const auto file = dir_ / ("cfg" + std::to_string(files_++) + ".json");
    std::ofstream(file) << c.dump();
    return file.string();
  }
  std::string jsonl(const std::string& name) { return (dir_ / (name + ".jsonl")).string(); }
  static train_gpt_runs::Run train(int ranks, const std::string& args) {
    return capture(std::string(STRATA_BIN_DIR) + "/strata-run --num_gpus " + std::to_string(ranks) +
                   " -- " + STRATA_BIN_DIR + "/train_gpt --device cpu --model tiny-tied " + args);
  }
  static void expect_same(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b,
                          size_t from, const std::string& what, double rtol = 1e-5) {
    ASSERT_EQ(a.size(), from + b.size()) << what;
    for (size_t i = 0; i < b.size(); ++i) {
      const double la = a[from + i].at("loss").get<double>(), lb = b[i].at("loss").get<double>();
      EXPECT_LE(std::abs(la - lb) / la, rtol) << what << ", step " << from + i + 1;
    }
  }
  void SetUp() override {
    BuildFsDirTest::SetUp();
    fs::create_directories(dir_ / "swap");
  }
  int files_ = 0;
};

TEST_F(TrainGptNvme, GivesTheLossesOfHostMemoryAndOfNoOffload) {
  for (int ranks : {1, 2}) {
    const std::string what = std::to_string(ranks) + " rank(s)";
    auto r = train(ranks, "--config " + config(3, "none") + " --steps 8 --metrics-jsonl " + jsonl("ref"));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
    r = train(ranks, "--config " + config(3, "cpu") + " --steps 8 --metrics-jsonl " + jsonl("cpu"));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
    for (bool pipelined : {true, false}) {
      r = train(ranks, "--config " + config(3, "nvme", pipelined) + " --steps 8 --metrics-jsonl " +
                           jsonl("nvme"));
      ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
      EXPECT_NE(r.output.find("optimizer offload to NVMe: fp32 master and Adam state"),
                std::string::npos) << r.output;
      const std::string how = what + (pipelined ? ", pipelined" : ", not pipelined");
      expect_same(read_jsonl(jsonl("ref")), read_jsonl(jsonl("nvme")), 0, how + " vs no offload");
      expect_same(read_jsonl(jsonl("cpu")), read_jsonl(jsonl("nvme")), 0, how + " vs cpu offload");
      // A normal exit leaves nothing under nvme_path.
      EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << how;
    }
  }
}

// One micro-step per step: the gradient partition goes to a swap file too (zero/gradient_swap.h),
// read back a tile at a time by the step.
TEST_F(TrainGptNvme, GradientsOnNvmeGiveTheLossesOfNoOffload) {
  for (int ranks : {1, 2}) {
    const std::string what = std::to_string(ranks) + " rank(s)";
    const int micro = 16 / ranks;  // train_batch_size 16: no accumulation
    auto r = train(ranks, "--config " + config(3, "none", true, "AdamW", "none", micro) +
                              " --steps 8 --metrics-jsonl " + jsonl("ref"));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
    for (const std::string params : {"none", "nvme"}) {
      r = train(ranks, "--config " + config(3, "nvme", true, "AdamW", params, micro) +
                           " --steps 8 --metrics-jsonl " + jsonl("nvme"));
      ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
      EXPECT_NE(r.output.find("gradients in a swap file"), std::string::npos) << r.output;
      expect_same(read_jsonl(jsonl("ref")), read_jsonl(jsonl("nvme")), 0,
                  what + ", parameters " + params);
      EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << what;
    }
  }
}

// The gradient swap file holds the communication dtype: an fp32 model whose gradients travel in
// fp16 or bf16 (communication_data_type, also under torch_autocast's fp32 parameters) has its
// shards and tiles on the 4 KiB grid of the narrower dtype. (The grid of the model's dtype put
// half the chunks off it: "GradientSwap::write: ... do not fit ... on the 4 KiB grid".)
TEST_F(TrainGptNvme, GradientsNarrowerThanTheModelGiveTheLossesOfNoOffload) {
  const int ranks = 2, micro = 8;  // train_batch_size 16: no accumulation, gradients swapped
  for (const nlohmann::json& patch :
       {nlohmann::json{{"communication_data_type", "fp16"}},
        nlohmann::json{{"communication_data_type", "bf16"}},
        nlohmann::json{{"communication_data_type", "bf16"},
                       {"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}}}) {
    const std::string what = patch.dump();
    auto r = train(ranks, "--config " + config(3, "none", true, "AdamW", "none", micro, patch) +
                              " --steps 8 --metrics-jsonl " + jsonl("ref"));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
    for (const std::string params : {"none", "nvme"}) {
      r = train(ranks, "--config " + config(3, "nvme", true, "AdamW", params, micro, patch) +
                           " --steps 8 --metrics-jsonl " + jsonl("nvme"));
      ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
      EXPECT_NE(r.output.find("gradients in a swap file"), std::string::npos) << r.output;
      expect_same(read_jsonl(jsonl("ref")), read_jsonl(jsonl("nvme")), 0,
                  what + ", parameters " + params);
      EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << what;
    }
  }
}

TEST_F(TrainGptNvme, ParameterOffloadGivesTheLossesWithout) {
  for (int ranks : {1, 2}) {
    if (strata::test::kSanitized && ranks == 1) continue;  // CI's time: 2 ranks under a sanitizer
    const std::string what = std::to_string(ranks) + " rank(s)";
    auto r = train(ranks, "--config " + config(3, "none") + " --steps 8 --metrics-jsonl " + jsonl("ref"));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
    for (const auto& [optimizer, params] : std::vector<std::pair<std::string, std::string>>{
             {"cpu", "cpu"}, {"cpu", "nvme"}, {"nvme", "nvme"}}) {
      const std::string how = what + ", optimizer " + optimizer + ", parameters " + params;
      r = train(ranks, "--config " + config(3, optimizer, true, "AdamW", params) +
                           " --steps 8 --metrics-jsonl " + jsonl("off"));
      ASSERT_EQ(r.exit_code, 0) << how << "\n" << r.output;
      EXPECT_NE(r.output.find("[strata] parameter offload: "), std::string::npos) << r.output;
      expect_same(read_jsonl(jsonl("ref")), read_jsonl(jsonl("off")), 0, how);
      EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << how;
    }
  }
  // A checkpoint of the parameters on NVMe resumes without offload, and the other way round.
  const std::string both = config(3, "nvme", true, "AdamW", "nvme");
  ASSERT_EQ(train(2, "--config " + both + " --steps 8 --metrics-jsonl " + jsonl("full")).exit_code, 0);
  const std::string ckpt = (dir_ / "ckpt").string();
  auto r = train(2, "--config " + both + " --steps 4 --save-dir " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(1, "--config " + config(3, "none") + " --steps 8 --resume " + ckpt + " --metrics-jsonl " +
                   jsonl("res"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res")), 4, "parameters from NVMe, no offload");
  const std::string ckpt2 = (dir_ / "ckpt2").string();
  ASSERT_EQ(train(1, "--config " + config(3, "none") + " --steps 4 --save-dir " + ckpt2).exit_code, 0);
  r = train(2, "--config " + both + " --steps 8 --resume " + ckpt2 + " --metrics-jsonl " + jsonl("res2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res2")), 4, "onto parameters on NVMe");
}

// Parameter offload alone (DeepSpeed allows it at stage 3): the 16-bit shards in host memory or
// a swap file, the fp32 master and Adam's moments on the model's device; each step stores the new
// master, cast, where the shards live. Micro-batches of 8 of 16 on 1 rank and of 4 on 2 ranks
// (2 micro-steps per step), of 8 on 2 ranks (one): the losses without offload, to 1e-6. Saved on
// 2 ranks with the shards on NVMe, resumed on 1 rank in host memory; saved on 1 rank in host
// memory, resumed on 2 on NVMe: the uninterrupted losses.
TEST_F(TrainGptNvme, ParameterOffloadWithTheOptimizerOnTheDeviceGivesTheLossesWithout) {
  for (const auto& [ranks, micro] : {std::pair{1, 8}, std::pair{2, 4}, std::pair{2, 8}}) {
    if (strata::test::kSanitized && !(ranks == 2 && micro == 4)) continue;  // CI's time
    const std::string what = std::to_string(ranks) + " rank(s), gas " + std::to_string(16 / ranks / micro);
    auto r = train(ranks, "--config " + config(3, "none", true, "AdamW", "none", micro) +
                              " --steps 6 --metrics-jsonl " + jsonl("ref"));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
    for (const std::string params : {"cpu", "nvme"}) {
      const std::string how = what + ", parameters " + params;
      r = train(ranks, "--config " + config(3, "none", true, "AdamW", params, micro) +
                           " --steps 6 --metrics-jsonl " + jsonl("off"));
      ASSERT_EQ(r.exit_code, 0) << how << "\n" << r.output;
      EXPECT_NE(r.output.find("the fp32 master and the optimizer state stay on the cpu"),
                std::string::npos) << r.output;
      expect_same(read_jsonl(jsonl("ref")), read_jsonl(jsonl("off")), 0, how, 1e-6);
      EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << how;
    }
  }
  const std::string nvme = config(3, "none", true, "AdamW", "nvme", 4);
  const std::string cpu = config(3, "none", true, "AdamW", "cpu", 4);
  ASSERT_EQ(train(2, "--config " + nvme + " --steps 6 --metrics-jsonl " + jsonl("full")).exit_code, 0);
  const std::string ckpt = (dir_ / "ckpt").string();
  auto r = train(2, "--config " + nvme + " --steps 3 --save-dir " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(1, "--config " + cpu + " --steps 6 --resume " + ckpt + " --metrics-jsonl " + jsonl("res"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res")), 3, "2 ranks on NVMe, resumed on 1");
  const std::string ckpt2 = (dir_ / "ckpt2").string();
  ASSERT_EQ(train(1, "--config " + cpu + " --steps 3 --save-dir " + ckpt2).exit_code, 0);
  r = train(2, "--config " + nvme + " --steps 6 --resume " + ckpt2 + " --metrics-jsonl " + jsonl("res2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res2")), 3, "1 rank in host memory, resumed on 2 on NVMe");
  EXPECT_TRUE(fs::is_empty(dir_ / "swap"));
}

TEST_F(TrainGptNvme, CheckpointsResumeOnNvmeAndInHostMemory) {
  const std::string nvme = config(3, "nvme");
  ASSERT_EQ(train(2, "--config " + nvme + " --steps 8 --metrics-jsonl " + jsonl("full")).exit_code, 0);
  const std::string ckpt = (dir_ / "ckpt").string();
  auto r = train(2, "--config " + nvme + " --steps 4 --save-dir " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(1, "--config " + config(3, "nvme", false) + " --steps 8 --resume " + ckpt +
                   " --metrics-jsonl " + jsonl("res_nvme"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res_nvme")), 4, "resumed on NVMe, 1 rank");
  r = train(1, "--config " + config(2, "cpu") + " --steps 8 --resume " + ckpt + " --metrics-jsonl " +
                   jsonl("res_cpu"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res_cpu")), 4, "resumed in host memory at stage 2");
  // And the other way: saved in host memory, resumed onto NVMe.
  const std::string ckpt2 = (dir_ / "ckpt2").string();
  ASSERT_EQ(train(1, "--config " + config(3, "cpu") + " --steps 4 --save-dir " + ckpt2).exit_code, 0);
  r = train(2, "--config " + nvme + " --steps 8 --resume " + ckpt2 + " --metrics-jsonl " + jsonl("res2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res2")), 4, "host memory onto NVMe, 2 ranks");
}

// The optimizer on NVMe at stage 3, micro-batches of 8 of train_batch_size 16 (one micro-step
// per step on 2 ranks, two on 1; with one, the gradients go to a swap file too): saved on 2 ranks
// after step 3 (micro-step counter 3), resumed on 1 rank with whole windows of two micro-steps;
// saved on 1 rank, resumed on 2: the uninterrupted run's losses.
TEST_F(TrainGptNvme, ResumeAtAnotherWorldSizeAfterAnOddStepKeepsWholeWindows) {
  const std::string nvme = config(3, "nvme", true, "AdamW", "none", 8);
  ASSERT_EQ(train(2, "--config " + nvme + " --steps 6 --metrics-jsonl " + jsonl("full")).exit_code, 0);
  for (const auto& [saved_on, resumed_on] : {std::pair{2, 1}, std::pair{1, 2}}) {
    const std::string how = "saved on " + std::to_string(saved_on) + " rank(s) after step 3, resumed on " +
                            std::to_string(resumed_on);
    const std::string ckpt = (dir_ / ("ckpt_odd" + std::to_string(saved_on))).string();
    auto r = train(saved_on, "--config " + nvme + " --steps 3 --save-dir " + ckpt);
    ASSERT_EQ(r.exit_code, 0) << how << "\n" << r.output;
    r = train(resumed_on, "--config " + nvme + " --steps 6 --resume " + ckpt + " --metrics-jsonl " +
                              jsonl("res_odd"));
    ASSERT_EQ(r.exit_code, 0) << how << "\n" << r.output;
    expect_same(read_jsonl(jsonl("full")), read_jsonl(jsonl("res_odd")), 3, how);
  }
}

TEST_F(TrainGptNvme, RefusesWhatItCannotRunBeforeStepOne) {
  // nvme_path that does not exist: named, not created.
  auto cfg = config(3, "nvme");
  fs::remove_all(dir_ / "swap");
  auto r = train(1, "--config " + cfg + " --steps 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find((dir_ / "swap").string()), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "swap"));
  // A file where the folder should be.
  std::ofstream(dir_ / "swap") << "x";
  r = train(1, "--config " + cfg + " --steps 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find((dir_ / "swap").string()), std::string::npos) << r.output;
  fs::remove(dir_ / "swap");
  fs::create_directories(dir_ / "swap");
  // SGD keeps state the swapper does not stream.
  r = train(1, "--config " + config(3, "nvme", true, "SGD") + " --steps 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("offload_optimizer.device \"nvme\" steps Strata's Adam/AdamW"),
            std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_empty(dir_ / "swap")) << "the refused run left its swap folder";
}

// nvme_path on a file system too small for the swap files, and on a read-only one: each run is
// refused before step 1 with the folder named, and leaves nothing there. The file systems are
// small tmpfs mounts in a mount namespace of the test's own child (skipped where this process may
// not mount); the store falls back to buffered I/O on tmpfs, which changes nothing here.
TEST_F(TrainGptNvme, FullOrReadOnlyFileSystemIsRefusedBeforeStepOne) {
  const fs::path mnt = dir_ / "small";
  fs::create_directories(mnt);
  const std::string metrics = jsonl("refused");
  const std::string cfg = config(3, "nvme");
  nlohmann::json c;
  std::ifstream(cfg) >> c;
  c["zero_optimization"]["offload_optimizer"]["nvme_path"] = mnt.string();
  std::ofstream(cfg) << c.dump();
  struct Case {
    const char* what;
    unsigned long flags;
    const char* options;
    const char* expected;
  };
  // tiny-tied's fp32 master and Adam's moments need about 1 MB: 128 KiB is full at once.
  for (const Case& k : {Case{"full", 0, "size=128k", "available"},
                        Case{"read-only", MS_RDONLY, "size=4m", "is not writable"}}) {
    SCOPED_TRACE(k.what);
    fs::remove(metrics);
    int out[2];
    ASSERT_EQ(pipe(out), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(out[0]);
      if (unshare(CLONE_NEWNS) != 0 ||
          mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
          mount("tmpfs", mnt.c_str(), "tmpfs", k.flags, k.options) != 0)
        _exit(77);
      const auto r = train(1, "--config " + cfg + " --steps 2 --metrics-jsonl " + metrics);
      const std::string report = std::to_string(r.exit_code) + "\n" + r.output;
      const bool left_nothing = fs::is_empty(mnt);
      if (write(out[1], report.data(), report.size()) < 0) _exit(2);
      _exit(left_nothing ? 0 : 1);
    }
    close(out[1]);
    std::string report;
    char buf[4096];
    for (ssize_t n; (n = read(out[0], buf, sizeof buf)) > 0;) report.append(buf, size_t(n));
    close(out[0]);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << status;
    if (WEXITSTATUS(status) == 77)
      GTEST_SKIP() << "cannot mount a small tmpfs here (needs CAP_SYS_ADMIN)";
    EXPECT_EQ(WEXITSTATUS(status), 0) << "the refused run left files on the small file system";
    const auto newline = report.find('\n');
    ASSERT_NE(newline, std::string::npos) << report;
    EXPECT_NE(report.substr(0, newline), "0") << report;
    EXPECT_NE(report.find(mnt.string()), std::string::npos) << report;
    EXPECT_NE(report.find(k.expected), std::string::npos) << report;
    EXPECT_TRUE(read_jsonl(metrics).empty()) << "a step ran before the refusal";
  }
}

}  // namespace
