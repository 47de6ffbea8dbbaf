// train_gpt --model tiny-moe (Strata's MoE layer in every block: 4 experts, top-2) on real
// processes: expert parallelism gives the losses of one rank, whatever the ep_size, world size
// and ZeRO stage (stage 3 and NVMe offload included), and its checkpoints move between ep_sizes
// and stages.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include "../sanitized.h"
#include "train_gpt_runs.h"

namespace {

using namespace train_gpt_runs;

constexpr int kSteps = 8;

// 8 samples per step, 2 per gate call on every run: 1 rank accumulates 4 micro-batches, 2 ranks
// 2, 4 ranks 1, so each gate call routes the same 2 x 64 tokens in every run (capacity is
// per call). Top-2 with the second expert sampled (noise keyed by the step), capacity factor 1:
// tokens are dropped.
nlohmann::json moe_config(int ep_size, bool drop_tokens, int stage, double clipping = 0.0) {
  return {{"train_batch_size", 8},
          {"train_micro_batch_size_per_gpu", 2},
          {"steps_per_print", 1000},
          {"gradient_clipping", clipping},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
          {"zero_optimization", {{"stage", stage}}},
          {"moe",
           {{"num_experts", 4},
            {"ep_size", ep_size},
            {"top_k", 2},
            {"capacity_factor", 1.0},
            {"min_capacity", 4},
            {"drop_tokens", drop_tokens},
            {"aux_loss_coef", 0.01}}}};
}

std::string write_config(const nlohmann::json& config, const std::string& name) {
  const std::string path =
      testing::TempDir() + "/moe_" + name + "_" + std::to_string(getpid()) + ".json";
  std::ofstream(path) << config.dump();
  return path;
}

std::string jsonl(const std::string& name) {
  return testing::TempDir() + "/moe_" + name + "_" + std::to_string(getpid()) + ".jsonl";
}

// Runs on `ranks` processes (1: without the launcher); the metrics rows.
std::vector<nlohmann::json> train(int ranks, const nlohmann::json& config, const std::string& name,
                                  const std::string& extra = "") {
  const std::string args = "--model tiny-moe --config " + write_config(config, name) +
                           " --steps " + std::to_string(kSteps) + " --metrics-jsonl " +
                           jsonl(name) + " " + extra;
  if (ranks == 1) {
    const auto r = run(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  } else {
    EXPECT_EQ(launch(ranks, args), "");
  }
  return read_jsonl(jsonl(name));
}

void expect_same_losses(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b,
                        const std::string& what, size_t from = 0) {
  ASSERT_EQ(a.size(), static_cast<size_t>(kSteps)) << what;
  ASSERT_EQ(b.size(), static_cast<size_t>(kSteps - from)) << what;
  for (size_t i = from; i < a.size(); ++i) {
    const double la = a[i].at("loss").get<double>(), lb = b[i - from].at("loss").get<double>();
    EXPECT_LE(std::abs(la - lb) / std::abs(la), 1e-5)
        << what << ", step " << i + 1 << ": " << la << " vs " << lb;
    EXPECT_NEAR(a[i].at("l_aux").get<double>(), b[i - from].at("l_aux").get<double>(), 1e-5)
        << what << ", step " << i + 1;
    EXPECT_EQ(a[i].at("dropped_tokens").get<int64_t>(), b[i - from].at("dropped_tokens").get<int64_t>())
        << what << ", step " << i + 1;
    // The gradient norm too (Adam alone would hide a wrongly scaled expert gradient).
    if (a[i].contains("grad_norm") && b[i - from].contains("grad_norm")) {
      const double ga = a[i].at("grad_norm").get<double>(), gb = b[i - from].at("grad_norm").get<double>();
      EXPECT_LE(std::abs(ga - gb) / ga, 1e-5) << what << ", step " << i + 1 << ": grad norm";
    }
  }
}

// ep_size 1 on 1 rank, 2 on 2 ranks, 4 on 4 ranks: the same losses (fp32, 1e-5), aux losses,
// dropped routes and gradient norms, at ZeRO stages 0 and 2, with and without token drops.
// Clipping acts at every step (norms are about 1.3-1.5), so that a wrongly scaled expert gradient
// shows in the losses.
void expect_ep_sizes_agree(bool drop_tokens) {
  constexpr double kClip = 0.5;
  for (int stage : {0, 2}) {
    const std::string tag = std::string(drop_tokens ? "drop" : "nodrop") + std::to_string(stage);
    const auto one = train(1, moe_config(1, drop_tokens, stage, kClip), tag + "_ep1");
    ASSERT_EQ(one.size(), static_cast<size_t>(kSteps));
    int64_t dropped = 0;
    for (const auto& row : one) dropped += row.at("dropped_tokens").get<int64_t>();
    if (drop_tokens) {
      EXPECT_GT(dropped, 0) << "the case must drop tokens to test drops";
    } else {
      EXPECT_EQ(dropped, 0);
    }
    for (int ep : {2, 4}) {
      const auto many =
          train(ep, moe_config(ep, drop_tokens, stage, kClip), tag + "_ep" + std::to_string(ep));
      expect_same_losses(one, many, "ep_size " + std::to_string(ep) + ", stage " + std::to_string(stage));
    }
  }
}

TEST(TrainGptMoE, EpSizesOneTwoFourGiveTheSameLossesWithDrops) { expect_ep_sizes_agree(true); }
TEST(TrainGptMoE, EpSizesOneTwoFourGiveTheSameLossesWithoutDrops) { expect_ep_sizes_agree(false); }

// ep_size 2 on 4 ranks (two expert-data-parallel replicas of each expert), clipping on: the
// expert gradients are averaged over their replicas and the norm counts each expert once, so
// the losses and the gradient norm are one rank's.
TEST(TrainGptMoE, ExpertDataParallelismWithClippingGivesOneRanksLosses) {
  const auto one = train(1, moe_config(1, true, 2, 0.05), "edp_ep1");
  const auto four = train(4, moe_config(2, true, 2, 0.05), "edp_ep2x2");
  expect_same_losses(one, four, "ep_size 2 on 4 ranks");
  ASSERT_EQ(four.size(), static_cast<size_t>(kSteps));
  for (size_t i = 0; i < one.size(); ++i) {
    const double a = one[i].at("grad_norm").get<double>(), b = four[i].at("grad_norm").get<double>();
    EXPECT_LE(std::abs(a - b) / a, 1e-5) << "step " << i + 1;
    EXPECT_GT(a, 0.05) << "clipping must act";
  }
}

// ZeRO-Offload with experts: both partitioned optimizers (the experts' over their expert-data-
// parallel group) step on the CPU in tiles; the losses and norms are those without offload.
TEST(TrainGptMoE, OptimizerOffloadWithExpertsGivesTheLossesWithout) {
  const auto plain = train(2, moe_config(2, true, 2, 0.5), "offload_without");
  auto offloaded = moe_config(2, true, 2, 0.5);
  offloaded["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  offloaded["zero_optimization"]["sub_group_size"] = 5000;
  expect_same_losses(plain, train(2, offloaded, "offload_with"), "offloaded optimizer");
}

// A checkpoint saved at ep_size 2 (2 ranks, stage 2) resumes at ep_size 4 (4 ranks, stage 1) and
// at ep_size 1 (1 rank, stage 0): the losses after it are those of the run that never stopped.
TEST(TrainGptMoE, CheckpointAtOneEpSizeResumesAtAnother) {
  const std::string dir = testing::TempDir() + "/moe_ckpt_" + std::to_string(getpid());
  const auto straight = train(2, moe_config(2, true, 2), "ckpt_straight");
  ASSERT_EQ(straight.size(), static_cast<size_t>(kSteps));
  // The first half, saved.
  auto half = moe_config(2, true, 2);
  {
    const std::string args = "--model tiny-moe --config " + write_config(half, "ckpt_half") +
                             " --steps " + std::to_string(kSteps / 2) + " --save-dir " + dir;
    ASSERT_EQ(launch(2, args), "");
  }
  const std::string resume = "--resume " + dir;
  const auto at4 = train(4, moe_config(4, true, 1), "ckpt_ep4", resume);
  expect_same_losses(straight, at4, "resumed at ep_size 4", kSteps / 2);
  const auto at1 = train(1, moe_config(1, true, 0), "ckpt_ep1", resume);
  expect_same_losses(straight, at1, "resumed at ep_size 1", kSteps / 2);
}

// ZeRO stage 3 with experts: each MoE layer's experts are a unit sharded over the expert-data-
// parallel group (ep_size 1 on 2 ranks: over both; ep_size 2 on 4 ranks: over pairs; ep_size 4 on
// 4 ranks: not at all) and gathered on use; the losses, aux losses, drops and gradient norms are
// one rank's at stage 2. Then the same with parameters and optimizer state of both the experts
// and the rest on NVMe.
TEST(TrainGptMoE, StageThreeShardsTheExpertsAndGivesOneRanksLosses) {
  const auto one = train(1, moe_config(1, true, 2, 0.5), "s3_ref");
  auto stage3 = [](int ep) {
    auto c = moe_config(ep, true, 3, 0.5);
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;  // experts gathered too
    return c;
  };
  for (const auto& [ranks, ep] : {std::pair{2, 1}, std::pair{4, 2}, std::pair{4, 4}}) {
    const std::string tag = "s3_" + std::to_string(ranks) + "ep" + std::to_string(ep);
    expect_same_losses(one, train(ranks, stage3(ep), tag), tag);
  }
  const std::string nvme = testing::TempDir() + "/moe_nvme_" + std::to_string(getpid());
  ASSERT_EQ(system(("mkdir -p " + nvme).c_str()), 0);
  auto offloaded = stage3(2);
  offloaded["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", nvme}};
  offloaded["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", nvme}};
  offloaded["zero_optimization"]["sub_group_size"] = 5000;
  expect_same_losses(one, train(4, offloaded, "s3_nvme"), "stage 3, experts on NVMe");
  // Every swap folder (the experts' files among them) is gone with the run.
  EXPECT_EQ(capture("ls -A " + nvme).output, "");
}

// Checkpoints between stage 3 and the others: saved at stage 3 (ep_size 2 on 4 ranks, experts
// sharded over pairs) it resumes at stage 2 with ep_size 4; saved at stage 2 with ep_size 2 it
// resumes at stage 3 with ep_size 1 on 2 ranks.
TEST(TrainGptMoE, StageThreeCheckpointsMoveToOtherStagesAndEpSizes) {
  const auto straight = train(1, moe_config(1, true, 2), "s3ck_straight");
  auto stage3 = [](int ep) {
    auto c = moe_config(ep, true, 3);
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    return c;
  };
  const std::string resume_from[] = {testing::TempDir() + "/moe_s3ck_a_" + std::to_string(getpid()),
                                     testing::TempDir() + "/moe_s3ck_b_" + std::to_string(getpid())};
  const std::string half = " --steps " + std::to_string(kSteps / 2) + " --save-dir ";
  ASSERT_EQ(launch(4, "--model tiny-moe --config " + write_config(stage3(2), "s3ck_save3") + half +
                          resume_from[0]),
            "");
  expect_same_losses(straight, train(4, moe_config(4, true, 2), "s3ck_to2", "--resume " + resume_from[0]),
                     "saved at stage 3, resumed at stage 2", kSteps / 2);
  ASSERT_EQ(launch(2, "--model tiny-moe --config " + write_config(moe_config(2, true, 2), "s3ck_save2") +
                          half + resume_from[1]),
            "");
  expect_same_losses(straight, train(2, stage3(1), "s3ck_to3", "--resume " + resume_from[1]),
                     "saved at stage 2, resumed at stage 3", kSteps / 2);
}

// Residual MoE (moe.use_residual, DeepSpeed's PR-MoE): the dense MLP and its coefficient are
// ordinary parameters beside the experts; ep_size 2 on 2 ranks gives one rank's losses at stage 2
// and at stage 3 (where they live in the dense units and the experts in theirs).
TEST(TrainGptMoE, ResidualMoEGivesOneRanksLossesAtStagesTwoAndThree) {
  auto residual = [](int ep, int stage) {
    auto c = moe_config(ep, true, stage, 0.5);
    c["moe"]["use_residual"] = true;
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    return c;
  };
  const auto one = train(1, residual(1, 2), "residual_ep1");
  const auto without = train(1, moe_config(1, true, 2, 0.5), "residual_without");
  ASSERT_EQ(one.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(without.size(), one.size());
  EXPECT_NE(one[0].at("loss").get<double>(), without[0].at("loss").get<double>())
      << "the residual MLP must change the model";
  expect_same_losses(one, train(2, residual(2, 2), "residual_ep2_s2"), "residual, ep 2, stage 2");
  expect_same_losses(one, train(2, residual(2, 3), "residual_ep2_s3"), "residual, ep 2, stage 3");
}

// A moe block that gives some keys and not num_experts: the model's gate fills the others and
// the given ones act (the engine would refuse layers that ignore one): here top_k 1 without drops
// gives the run whose block spells out every value.
TEST(TrainGptMoE, ABlockWithoutNumExpertsSetsTheKeysItGives) {
  auto partial = moe_config(1, true, 0);
  partial["moe"] = {{"top_k", 1}, {"drop_tokens", false}};
  const auto some = train(1, partial, "partial_block");
  ASSERT_EQ(some.size(), static_cast<size_t>(kSteps));
  for (const auto& row : some) EXPECT_EQ(row.at("dropped_tokens").get<int64_t>(), 0);
  auto full = moe_config(1, true, 0);
  full["moe"] = {{"num_experts", 4},          {"top_k", 1},
                 {"capacity_factor", 1.25},   {"eval_capacity_factor", 1.25},
                 {"drop_tokens", false},      {"aux_loss_coef", 0.01}};
  expect_same_losses(some, train(1, full, "partial_full"), "keys given vs spelled out");
}

// DeepSeek-V3's MoE on tiny-moe: sigmoid scores with the balancing bias (moved after every step
// by the loads summed over micro-batches and ranks), a shared expert, dropless, no auxiliary
// loss. ep_size 2 on 2 ranks and 4 on 4 ranks give one rank's losses at stages 2 and 3, and a run
// saved after step 4 at ep 2 resumes at ep 4 with the bias it had (the steps after it equal).
nlohmann::json deepseek_config(int ep_size, int stage) {
  auto c = moe_config(ep_size, false, stage);
  c["moe"]["score_func"] = "sigmoid";
  c["moe"]["bias_update_speed"] = 0.05;  // fast enough to move the routes within 8 steps
  c["moe"]["n_shared_experts"] = 1;
  c["moe"]["aux_loss_coef"] = 0.0;
  c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  return c;
}

TEST(TrainGptMoE, DeepSeekRouterGivesOneRanksLossesAtEveryEpSize) {
  const auto one = train(1, deepseek_config(1, 2), "ds_ep1");
  ASSERT_EQ(one.size(), static_cast<size_t>(kSteps));
  auto plain = deepseek_config(1, 2);
  plain["moe"]["bias_update_speed"] = 0.0;
  const auto unbiased = train(1, plain, "ds_nobias");
  ASSERT_EQ(unbiased.size(), one.size());
  EXPECT_EQ(one[0].at("loss").get<double>(), unbiased[0].at("loss").get<double>())
      << "the bias starts at zero";
  EXPECT_NE(one.back().at("loss").get<double>(), unbiased.back().at("loss").get<double>())
      << "the bias must move the routes";
  for (const auto& row : one) EXPECT_EQ(row.at("dropped_tokens").get<int64_t>(), 0);
  expect_same_losses(one, train(2, deepseek_config(2, 2), "ds_ep2_s2"), "deepseek, ep 2, stage 2");
  expect_same_losses(one, train(4, deepseek_config(4, 2), "ds_ep4_s2"), "deepseek, ep 4, stage 2");
  expect_same_losses(one, train(2, deepseek_config(2, 3), "ds_ep2_s3"), "deepseek, ep 2, stage 3");
  expect_same_losses(one, train(4, deepseek_config(4, 3), "ds_ep4_s3"), "deepseek, ep 4, stage 3");

  const std::string dir = testing::TempDir() + "/moe_ds_ckpt_" + std::to_string(getpid());
  auto first = deepseek_config(2, 2);
  const std::string save = "--model tiny-moe --config " + write_config(first, "ds_save") +
                           " --steps 4 --save-dir " + dir;
  ASSERT_EQ(launch(2, save), "");
  const auto resumed = train(4, deepseek_config(4, 3), "ds_resume", "--resume " + dir);
  expect_same_losses(one, resumed, "deepseek, saved at ep 2, resumed at ep 4 stage 3", 4);
}

// The variable-split exchange (issue 53) where features meet: exchange_chunks 2 (two chunks of
// local experts at ep_size 2; one at ep_size 4, a chunk per expert), activation checkpointing of
// every block (the exchange replays in the recomputation), 2 micro-batches of accumulation at
// ep_size 2, stages 2 and 3, drops and dropless, and the DeepSeek-style router: one rank's losses.
TEST(TrainGptMoE, ChunkedExchangeWithCheckpointingGivesOneRanksLosses) {
  const std::string ac = "--activation-checkpointing every";
  // Under a sanitizer (CI's suite, 3-25x slower) drops only, and the DeepSeek router at ep 2.
  for (const bool drop : {true, false}) {
    if (strata::test::kSanitized && !drop) continue;
    const std::string tag = drop ? "xc_drop" : "xc_nodrop";
    const auto one = train(1, moe_config(1, drop, 0), tag + "_ep1");
    for (const auto& [ep, stage] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{4, 3}}) {
      auto c = moe_config(ep, drop, stage);
      c["moe"]["exchange_chunks"] = 2;
      const auto name = tag + "_ep" + std::to_string(ep) + "_s" + std::to_string(stage);
      expect_same_losses(one, train(ep, c, name, ac),
                         name + " (chunks 2, checkpointing every)");
    }
  }
  const auto one = train(1, deepseek_config(1, 2), "xc_ds_ep1");
  for (const int ep : {2, 4}) {
    if (strata::test::kSanitized && ep == 4) continue;
    auto c = deepseek_config(ep, 3);
    c["moe"]["exchange_chunks"] = 2;
    expect_same_losses(one, train(ep, c, "xc_ds_ep" + std::to_string(ep), ac),
                       "deepseek, ep " + std::to_string(ep) + ", stage 3, chunks 2, checkpointing");
  }
}

// Bad MoE set-ups are refused before training, by name.
TEST(TrainGptMoE, MismatchedSetUpsAreClearErrors) {
  // ep_size that does not divide the world.
  const auto r = capture(std::string(STRATA_BIN_DIR) + "/strata-run --num_gpus 3 -- " +
                         STRATA_BIN_DIR + "/train_gpt --device cpu --model tiny-moe --steps 1 --config " +
                         write_config(moe_config(2, true, 0), "bad_world"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("ep_size"), std::string::npos) << r.output;
  // An MoE model built in shards (--zero-init: PartitionedInit shards over the whole world).
  const auto s3 = run("--model tiny-moe --steps 1 --zero-init --config " +
                      write_config(moe_config(1, true, 3), "bad_s3"));
  EXPECT_NE(s3.exit_code, 0);
  EXPECT_NE(s3.output.find("PartitionedInit"), std::string::npos) << s3.output;
  // A config naming another number of experts than the model has.
  auto other = moe_config(1, true, 0);
  other["moe"]["num_experts"] = 8;
  const auto e8 = run("--model tiny-moe --steps 1 --config " + write_config(other, "bad_e8"));
  EXPECT_NE(e8.exit_code, 0);
  EXPECT_NE(e8.output.find("num_experts"), std::string::npos) << e8.output;
}

}  // namespace
