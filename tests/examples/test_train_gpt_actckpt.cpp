// train_gpt --activation-checkpointing on real processes (issue 32): with every block
// checkpointed, and selective, each step's loss and gradient norm equal those of the run without
// checkpointing (relative 1e-6) on a model with dropout (tiny-dropout: attention and residual
// dropout 0.1), at ZeRO stages 0-3 on 1 and 2 ranks, with gradient accumulation 2; tiny-moe with
// noise (Jitter, the 2nd expert sampled) at ep_size 1 and 2; under bf16 and torch_autocast; with
// the checkpointed inputs in host memory (cpu_checkpointing) and in NVMe swap files, whose folder
// is empty after the run. The gradient norm is the engine's (global, before clipping), so a
// gradient lost or changed anywhere shows; later steps' losses show the weights moved the same.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "train_gpt_runs.h"
#include "../offload/build_fs_dir.h"

namespace {

using namespace train_gpt_runs;
namespace fs = std::filesystem;

constexpr int kSteps = 2;

class TrainGptActivationCheckpointing : public strata::test_support::BuildFsDirTest {
 protected:
  TrainGptActivationCheckpointing() : BuildFsDirTest("train-gpt-actckpt") {}

  // micro-batch 2, gas 2, AdamW at a learning rate that moves the weights; clipping on, so the
  // engine computes the gradient norm on every path.
  static nlohmann::json config(int stage, int world) {
    nlohmann::json c = {
        {"train_batch_size", 2 * 2 * world},
        {"train_micro_batch_size_per_gpu", 2},
        {"gradient_accumulation_steps", 2},
        {"steps_per_print", 1000},
        {"gradient_clipping", 1.0},
        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
        {"zero_optimization", {{"stage", stage}}}};
    if (stage == 3)  // prefetch by the trace: the recomputed order must be followed
      c["zero_optimization"].update({{"stage3_prefetch_bucket_size", 20000},
                                     {"stage3_param_persistence_threshold", 0}});
    return c;
  }

  struct Result {
    std::vector<nlohmann::json> rows;
    std::string output;
  };

  Result train(int ranks, const nlohmann::json& c, const std::string& model,
               const std::string& policy) {
    const std::string name = "run" + std::to_string(runs_++);
    const auto cfg = (dir_ / (name + ".json")).string();
    const auto metrics = (dir_ / (name + ".jsonl")).string();
    std::ofstream(cfg) << c.dump();
    const std::string args = "--config " + cfg + " --model " + model + " --steps " +
                             std::to_string(kSteps) + " --metrics-jsonl " + metrics +
                             " --activation-checkpointing " + policy;
    train_gpt_runs::Run r = ranks == 1 ? train_gpt_runs::run(args)
                       : capture(std::string(STRATA_BIN_DIR) + "/strata-run --num_gpus " +
                                 std::to_string(ranks) + " -- " + STRATA_BIN_DIR +
                                 "/train_gpt --device cpu " + args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return {read_jsonl(metrics), r.output};
  }

  static void expect_same(const Result& ref, const Result& got, const std::string& what) {
    ASSERT_EQ(ref.rows.size(), size_t(kSteps)) << what << "\n" << ref.output;
    ASSERT_EQ(got.rows.size(), size_t(kSteps)) << what << "\n" << got.output;
    for (size_t i = 0; i < ref.rows.size(); ++i)
      for (const char* key : {"loss", "grad_norm", "l_aux"}) {
        if (!ref.rows[i].contains(key)) continue;
        const double a = ref.rows[i].at(key).get<double>(), b = got.rows[i].at(key).get<double>();
        EXPECT_LE(std::abs(a - b), 1e-6 * std::abs(a))
            << what << ", step " << i + 1 << ", " << key << ": " << a << " vs " << b;
      }
  }

  // The policies against no checkpointing, on `ranks` processes; returns the run without.
  Result compare_policies(int ranks, const nlohmann::json& c, const std::string& model,
                          const std::string& what) {
    auto ref = train(ranks, c, model, "none");
    for (const std::string policy : {"every", "selective"}) {
      const auto got = train(ranks, c, model, policy);
      expect_same(ref, got, what + ", " + policy);
      EXPECT_EQ(got.output.find("gathering on use from here"), std::string::npos)
          << what << ", " << policy << ": ZeRO-3 left its recorded order\n" << got.output;
    }
    return ref;
  }

  // Every block checkpointed with its inputs in host memory, then on NVMe under dir_/swap_name,
  // against `ref` (the same config without checkpointing): the same numbers, `checkpoints`
  // checkpoints a micro-step, the swap folder empty at exit.
  void compare_stores(int ranks, const nlohmann::json& c, const std::string& model, const Result& ref,
                      int checkpoints, const std::string& swap_name, const std::string& what) {
    auto host = c;
    host["activation_checkpointing"] = {{"cpu_checkpointing", true}, {"profile", true}};
    auto got = train(ranks, host, model, "every");
    expect_same(ref, got, what + "cpu_checkpointing");
    EXPECT_NE(got.output.find("activation checkpointing, micro-step 1: " + std::to_string(checkpoints) +
                              " checkpoints"),
              std::string::npos) << got.output;
    const auto swap = dir_ / swap_name;
    fs::create_directories(swap);
    auto nvme = c;
    nvme["activation_checkpointing"] = {{"nvme_path", swap.string()}};
    got = train(ranks, nvme, model, "every");
    expect_same(ref, got, what + "nvme_path");
    EXPECT_NE(got.output.find("checkpointed inputs in swap files under"), std::string::npos)
        << got.output;
    EXPECT_TRUE(fs::is_empty(swap)) << "the swap folder is removed at exit";
  }

  int runs_ = 0;
};

TEST_F(TrainGptActivationCheckpointing, ZeroStagesOnOneAndTwoRanksGiveTheLossesAndGradientsOfNoCheckpointing) {
  for (int ranks : {1, 2})
    for (int stage = 0; stage <= 3; ++stage)
      compare_policies(ranks, config(stage, ranks), "tiny-dropout",
                       "stage " + std::to_string(stage) + ", " + std::to_string(ranks) + " rank(s)");
}

// Without dropout a block is checkpointed as its two residual branches: ZeRO-3 gathers the
// branches' units again in their recomputation, in the recorded order; the branches' inputs
// (two per block) go to host memory or NVMe and come back in the same numbers.
TEST_F(TrainGptActivationCheckpointing, BlocksAsTwoBranchesAtStageThreeOnTwoRanks) {
  const auto ref = compare_policies(2, config(3, 2), "tiny", "tiny without dropout, stage 3, 2 ranks");
  // tiny's 2 blocks, 2 branches each.
  compare_stores(2, config(3, 2), "tiny", ref, 4, "swap3", "stage 3, two branches, ");
}

TEST_F(TrainGptActivationCheckpointing, MoEWithNoiseAtEpSizeOneAndTwo) {
  for (int ep : {1, 2}) {
    auto c = config(1, 2);
    c["moe"] = {{"num_experts", 4},       {"ep_size", ep},        {"top_k", 2},
                {"capacity_factor", 1.0}, {"min_capacity", 4},    {"noisy_gate_policy", "Jitter"},
                {"aux_loss_coef", 0.01}};
    compare_policies(2, c, "tiny-moe-dropout", "tiny-moe, ep_size " + std::to_string(ep));
  }
}

TEST_F(TrainGptActivationCheckpointing, Bf16AndTorchAutocast) {
  auto bf16 = config(0, 1);
  bf16["bf16"] = {{"enabled", true}};
  compare_policies(1, bf16, "tiny-dropout", "bf16");
  auto autocast = config(0, 1);
  autocast["torch_autocast"] = {{"enabled", true}, {"dtype", "bfloat16"}};
  compare_policies(1, autocast, "tiny-dropout", "torch_autocast bf16");
}

TEST_F(TrainGptActivationCheckpointing, HostMemoryAndNvmeGiveTheSameNumbersAndLeaveNoFiles) {
  const auto ref = train(2, config(2, 2), "tiny-dropout", "none");
  // tiny's 2 blocks, each whole under dropout (the loss is fused with the head, not checkpointed).
  compare_stores(2, config(2, 2), "tiny-dropout", ref, 2, "swap", "");
}

}  // namespace
