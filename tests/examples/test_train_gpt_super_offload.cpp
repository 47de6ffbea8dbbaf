// offload_optimizer.super_offload (zero/speculative_step.h) on real processes: the speculative CPU
// step leaves every rank's optimizer state (fp32 master and both Adam moments, --state-digest)
// and every loss bit for bit those of the synchronous offloaded step, after every step, over runs
// where clipping applies at some steps and not at others (the speculation redone at the first,
// kept at the second): 2 ranks with gradient accumulation 2 at stages 1-3 in fp32 and bf16, stage 3
// with offload_param cpu and nvme, one rank at stages 1-2 (where the step's tiles go to the next
// forward as they are stepped), and the MoE experts' optimizer beside the dense one.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "../sanitized.h"
#include "train_gpt_runs.h"

namespace {

using namespace train_gpt_runs;

std::string temp(const std::string& name) {
  return testing::TempDir() + "/super_offload_" + std::to_string(getpid()) + "_" + name;
}

struct Case {
  int stage, ranks;
  std::string precision, params, model = "tiny-tied";
  double clip = 2.3;  // between the norms of the tiny models' first steps
  double ratio = 1.0;  // offload_optimizer.ratio
};

std::vector<nlohmann::json> train(const Case& c, bool speculative, const std::string& name,
                                  const std::string& extra = "", int steps = 6) {
  nlohmann::json config;
  std::ifstream(std::string(STRATA_SOURCE_DIR) + "/configs/gpt_tiny_dp.json") >> config;
  config.erase("launcher");
  config.erase("gradient_accumulation_steps");
  config["train_batch_size"] = 16;
  config["train_micro_batch_size_per_gpu"] = 4;  // 2 ranks: accumulation 2; 1 rank: 4
  config["gradient_clipping"] = c.clip;
  if (c.precision == "bf16") config["bf16"] = {{"enabled", true}};
  config["zero_optimization"] = {
      {"stage", c.stage},
      {"reduce_bucket_size", 20000},
      {"sub_group_size", 7000},
      {"stage3_param_persistence_threshold", 0},
      {"offload_optimizer", {{"device", "cpu"}, {"super_offload", speculative}, {"ratio", c.ratio}}}};
  if (c.params != "none") {
    config["zero_optimization"]["offload_param"] = {{"device", c.params}};
    if (c.params == "nvme") {
      std::filesystem::create_directories(temp(name + "_swap"));
      config["zero_optimization"]["offload_param"]["nvme_path"] = temp(name + "_swap");
    }
  }
  if (c.model == "tiny-moe")  // experts over 2 ranks: their optimizer is a group of its own
    config["moe"] = {{"num_experts", 4},     {"ep_size", 2},        {"top_k", 2},
                     {"capacity_factor", 1.0}, {"min_capacity", 4}, {"drop_tokens", true},
                     {"aux_loss_coef", 0.01}};
  const auto path = temp(name + ".json");
  std::ofstream(path) << config.dump();
  const auto metrics = temp(name + ".jsonl");
  const auto r = capture(std::string(STRATA_BIN_DIR) + "/strata-run --num_gpus " +
                         std::to_string(c.ranks) + " -- " + STRATA_BIN_DIR +
                         "/train_gpt --device cpu --model " + c.model + " --config " + path +
                         " --steps " + std::to_string(steps) + " --state-digest --metrics-jsonl " +
                         metrics + " " + extra);
  EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  if (speculative) {
    EXPECT_NE(r.output.find("super_offload: each step starts during backward"), std::string::npos)
        << r.output;
  }
  if (c.ratio < 1) {
    EXPECT_NE(r.output.find("keep their master and moments on the cpu"), std::string::npos)
        << r.output;
  }
  return read_jsonl(metrics);
}

TEST(TrainGptSuperOffload, EqualsTheSynchronousStepBitForBit) {
  // Under a sanitizer (CI's time) one of them: stage 2 on 2 ranks (the in-process test covers the
  // stages, OffloadedOptimizer.SpeculativeStepEqualsTheSynchronousStepBitForBit).
  const std::vector<Case> cases =
      strata::test::kSanitized
          ? std::vector<Case>{{2, 2, "bf16", "none"}}
          : std::vector<Case>{{1, 2, "fp32", "none"}, {1, 2, "bf16", "none"}, {2, 2, "fp32", "none"},
                              {2, 2, "bf16", "none"}, {3, 2, "fp32", "none"}, {3, 2, "bf16", "none"},
                              {3, 2, "bf16", "cpu"},  {3, 2, "fp32", "nvme"}, {1, 1, "fp32", "none"},
                              {2, 1, "bf16", "none"}, {2, 2, "fp32", "none", "tiny-moe", 1.27}};
  for (const auto& c : cases) {
    const std::string name = "s" + std::to_string(c.stage) + "_r" + std::to_string(c.ranks) + "_" +
                             c.precision + "_" + c.params + "_" + c.model;
    const auto sync = train(c, false, name + "_sync");
    const auto spec = train(c, true, name + "_spec");
    ASSERT_EQ(sync.size(), 6u) << name;
    ASSERT_EQ(spec.size(), 6u) << name;
    for (size_t i = 0; i < sync.size(); ++i) {
      EXPECT_EQ(sync[i].at("loss").get<double>(), spec[i].at("loss").get<double>())
          << name << ", step " << i + 1;
      EXPECT_EQ(sync[i].at("state_digest"), spec[i].at("state_digest")) << name << ", step " << i + 1;
    }
    // Both kinds of step happened: some speculations kept, some redone (clipping applied).
    const auto& last = spec.back();
    ASSERT_TRUE(last.contains("speculated_steps")) << name << ": " << last.dump();
    EXPECT_EQ(last.at("speculated_steps").get<int64_t>(), 6) << name;
    const auto redone = last.at("redone_steps").get<int64_t>();
    EXPECT_GT(redone, 0) << name << ": no step clipped (" << last.dump() << ")";
    EXPECT_LT(redone, 6) << name << ": every step clipped (" << last.dump() << ")";
  }
}

// offload_optimizer.ratio 0.5 at stages 1-2 (a share of the optimizer kept on the model's device:
// here the CPU, so the same kernels): the losses of ratio 1 to 1e-5 (the norm is summed in
// another order), the speculative step still equal to the synchronous one bit for bit, and a
// checkpoint saved on 2 ranks at stage 2 with the share resumed on 1 rank at stage 1 without it
// gives the straight run's losses (the share's state goes through the host master on save).
TEST(TrainGptSuperOffload, RatioKeepsAShareOnTheDeviceAndResumesWithout) {
  for (int stage : {1, 2}) {
    if (strata::test::kSanitized) break;  // CI's time: the resume only
    const std::string name = "ratio_s" + std::to_string(stage);
    const Case whole{stage, 2, "fp32", "none"};
    Case half = whole;
    half.ratio = 0.5;
    const auto base = train(whole, false, name + "_whole");
    const auto sync = train(half, false, name + "_sync");
    const auto spec = train(half, true, name + "_spec");
    ASSERT_EQ(base.size(), 6u);
    ASSERT_EQ(sync.size(), 6u);
    ASSERT_EQ(spec.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      const double a = base[i].at("loss").get<double>(), b = sync[i].at("loss").get<double>();
      EXPECT_LE(std::abs(a - b) / a, 1e-5) << name << ", step " << i + 1;
      EXPECT_EQ(sync[i].at("loss").get<double>(), spec[i].at("loss").get<double>()) << name;
      EXPECT_EQ(sync[i].at("state_digest"), spec[i].at("state_digest")) << name << ", step " << i + 1;
    }
  }
  Case half{2, 2, "fp32", "none"};
  half.ratio = 0.5;
  const auto straight = train(half, true, "ratio_straight");
  const std::string dir = temp("ratio_ckpt");
  ASSERT_EQ(train(half, true, "ratio_save", "--save-dir " + dir, 3).size(), 3u);
  const Case resumed{1, 1, "fp32", "none"};
  const auto rows = train(resumed, false, "ratio_resumed", "--resume " + dir);
  ASSERT_EQ(rows.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const double a = straight[3 + i].at("loss").get<double>(), b = rows[i].at("loss").get<double>();
    EXPECT_LE(std::abs(a - b) / a, 1e-5) << "resumed step " << 4 + i;
  }
}

// The config's rules: no effect without optimizer offload (read as false, said), refused with the
// state on NVMe (it speculates on state in host memory), and with an optimizer other than
// Strata's Adam (its numbers cannot be taken before the step).
TEST(TrainGptSuperOffload, RefusedWhereItCannotSpeculate) {
  auto write = [](const std::string& name, const nlohmann::json& zero, const nlohmann::json& opt) {
    nlohmann::json c = {{"train_micro_batch_size_per_gpu", 4}, {"zero_optimization", zero},
                        {"optimizer", opt}};
    const auto path = temp(name + ".json");
    std::ofstream(path) << c.dump();
    return path;
  };
  const nlohmann::json adam = {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}};
  auto r = run("--model tiny --steps 1 --config " +
               write("none", {{"stage", 2}, {"offload_optimizer", {{"super_offload", true}}}}, adam));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("super_offload has no effect without optimizer offload"),
            std::string::npos) << r.output;
  r = run("--model tiny --steps 1 --config " +
          write("nvme", {{"stage", 3}, {"offload_optimizer",
                                        {{"device", "nvme"}, {"nvme_path", testing::TempDir()},
                                         {"super_offload", true}}}},
                adam));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("super_offload speculates the CPU step on state in host memory"),
            std::string::npos) << r.output;
  r = run("--model tiny --steps 1 --config " +
          write("sgd", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"super_offload", true}}}},
                {{"type", "SGD"}, {"params", {{"lr", 1e-3}, {"momentum", 0.9}}}}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("super_offload speculates Strata's CPU Adam"), std::string::npos)
      << r.output;
}

}  // namespace
