// A user's own MoE model through the engine (issue 29), written as the README's "Your own MoE
// model" says and calling nothing else: layers from the config's moe block (one top-1 layer with
// random token selection, one top-2 layer with 2nd-expert sampling, so the gates' noise decides
// which routes are dropped over capacity), each layer's loss() added, a WarmupLR schedule, data
// sliced as the guide says (micro-batch m of rank r is the step's chunk m * world + r).
// It trains at ep_size 2 on 4 ranks and saves after 3 steps; the checkpoint then resumes at
// ep_size 4 on 4 ranks and at ep_size 2 on 2 ranks (2 micro-steps per step, the same global
// batch), each giving the straight run's losses (1e-6, fp32), at ZeRO stages 2 and 3.
// The ranks are this binary re-run through strata-run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "moe/layer.h"
#include "runtime/util/file_tree.h"
#include "runtime/engine.h"
#include "tests/runtime/engine/launch_workers.h"

namespace {

using strata::json;
namespace nn = torch::nn;

constexpr const char* kWorker = "STRATA_USER_MOE_WORKER";
bool is_worker() { return strata::test_support::is_worker(kWorker); }

constexpr int64_t kVocab = 32, kWidth = 16, kFfn = 24, kSeqLen = 6, kMicro = 2, kBatch = 8;
constexpr int kSteps = 6, kSaveAfter = 3;

// One pre-norm residual block around an MoE layer.
struct BlockImpl : nn::Module {
  BlockImpl(strata::moe::MoEOptions o) {
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({kWidth})));
    moe = register_module("moe", strata::moe::MoE(std::move(o)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + moe(norm(x)); }
  nn::LayerNorm norm{nullptr};
  strata::moe::MoE moe{nullptr};
};
TORCH_MODULE(Block);

struct UserMoENetImpl : nn::Module {
  UserMoENetImpl(const strata::Config& config, const strata::comm::GroupPtr& world) {
    emb = register_module("emb", nn::Embedding(kVocab, kWidth));
    auto top1 = strata::moe::MoEOptions::from_config(config.moe, kWidth, kFfn, 0, 1234, world);
    auto top2 = strata::moe::MoEOptions::from_config(config.moe, kWidth, kFfn, 1, 1234, world);
    top2.k = 2;  // the config gives no top_k: each layer chooses its own
    block0 = register_module("block0", Block(top1));
    block1 = register_module("block1", Block(top2));
    head = register_module("head", nn::Linear(kWidth, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto logits = head(block1(block0(emb(x))));
    return nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1})) +
           block0->moe->loss() + block1->moe->loss();
  }
  nn::Embedding emb{nullptr};
  Block block0{nullptr}, block1{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(UserMoENet);

json config(int stage, int ep_size) {
  return {{"train_batch_size", kBatch},
          {"train_micro_batch_size_per_gpu", kMicro},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-2}, {"weight_decay", 0.01}}}}},
          {"scheduler",
           {{"type", "WarmupLR"},
            {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 2e-2}, {"warmup_num_steps", 4}}}}},
          {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}},
          {"moe",
           {{"num_experts", 4},
            {"ep_size", ep_size},
            {"capacity_factor", 1.0},
            {"min_capacity", 1},
            {"use_rts", true},
            {"top2_2nd_expert_sampling", true}}}};
}

// The step's sample chunk `chunk` (kMicro sequences): a function of (step, chunk) only.
std::pair<torch::Tensor, torch::Tensor> chunk_of(int step, int64_t chunk) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + chunk + 1));
  auto x = torch::randint(0, kVocab, {kMicro, kSeqLen}, gen);
  return {x, (x * 5 + 3) % kVocab};
}

int env_int(const char* name) { return std::atoi(std::getenv(name)); }
std::string env_str(const char* name) { return std::getenv(name); }

// One worker run: STAGE, EP, FIRST_STEP (0: fresh, else load CKPT first), SAVE (save to CKPT
// after step kSaveAfter), OUT (rank 0 writes one loss per line: the global batch's mean).
TEST(UserMoEWorker, Trains) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see UserMoERanks.*)";
  strata::InitOptions init;
  auto cfg = strata::load_engine_config(config(env_int("STAGE"), env_int("EP")), init);
  torch::manual_seed(42);  // the same dense start on every rank (the engine also broadcasts)
  UserMoENet net(cfg, init.group);
  auto engine =
      std::make_shared<strata::ModelEngine<UserMoENet>>(net, std::move(cfg), std::move(init));
  const int first = env_int("FIRST_STEP");
  const std::string ckpt = env_str("CKPT");
  if (first > 0) engine->load_checkpoint(ckpt);
  const int64_t world = engine->data_parallel_size(), rank = engine->data_parallel_rank();
  const int64_t gas = engine->gradient_accumulation_steps();
  std::ofstream out;
  if (rank == 0) out.open(env_str("OUT"));
  for (int step = first; step < kSteps; ++step) {
    auto loss_sum = torch::zeros({});
    for (int64_t m = 0; m < gas; ++m) {
      const auto [x, y] = chunk_of(step, m * world + rank);
      auto loss = engine->forward(x, y);
      engine->backward(loss);
      engine->step();
      loss_sum += loss.detach();
    }
    engine->data_parallel_group()->all_reduce(loss_sum, strata::comm::ReduceOp::Sum);
    if (rank == 0) out << fmt::format("{:.17g}\n", loss_sum.item<double>() / double(world * gas));
    if (env_int("SAVE") && step + 1 == kSaveAfter) engine->save_checkpoint(ckpt);
  }
}

std::vector<double> read_losses(const std::string& path) {
  std::vector<double> out;
  std::ifstream in(path);
  for (double v; in >> v;) out.push_back(v);
  return out;
}

std::vector<double> run(int ranks, int stage, int ep, int first, bool save,
                        const std::string& ckpt, const std::string& out_path) {
  ::setenv("STAGE", std::to_string(stage).c_str(), 1);
  ::setenv("EP", std::to_string(ep).c_str(), 1);
  ::setenv("FIRST_STEP", std::to_string(first).c_str(), 1);
  ::setenv("SAVE", save ? "1" : "0", 1);
  ::setenv("CKPT", ckpt.c_str(), 1);
  ::setenv("OUT", out_path.c_str(), 1);
  std::string output;
  const int code =
      strata::test_support::launch_workers(kWorker, ranks, "UserMoEWorker.*", &output);
  EXPECT_EQ(code, 0) << output;
  return read_losses(out_path);
}

void resume_at_other_layouts(int stage) {
  const std::string dir = testing::TempDir() + "/user_moe_" + std::to_string(getpid()) + "_" +
                          std::to_string(stage);
  std::filesystem::create_directories(dir);
  const std::string ckpt = dir + "/ckpt";
  const auto straight = run(4, stage, 2, 0, true, ckpt, dir + "/straight.txt");
  ASSERT_EQ(straight.size(), size_t(kSteps));
  for (double l : straight) ASSERT_TRUE(std::isfinite(l));
  // It trains.
  EXPECT_LT(straight.back(), straight.front());
  struct Layout {
    int ranks, ep;
  };
  for (const Layout layout : {Layout{4, 4}, Layout{2, 2}}) {
    SCOPED_TRACE(fmt::format("resumed at ep_size {} on {} ranks", layout.ep, layout.ranks));
    const auto resumed = run(layout.ranks, stage, layout.ep, kSaveAfter, false, ckpt,
                             dir + fmt::format("/resumed_{}_{}.txt", layout.ranks, layout.ep));
    ASSERT_EQ(resumed.size(), size_t(kSteps - kSaveAfter));
    for (size_t i = 0; i < resumed.size(); ++i)
      EXPECT_NEAR(resumed[i], straight[kSaveAfter + i], 1e-6 * std::abs(straight[kSaveAfter + i]))
          << "step " << kSaveAfter + i + 1;
  }
  strata::util::remove_tree(dir);  // not std::filesystem: see README, pip LibTorch
}

TEST(UserMoERanks, ResumesAtOtherExpertAndWorldSizesAtStage2) {
  if (is_worker()) GTEST_SKIP();
  resume_at_other_layouts(2);
}

TEST(UserMoERanks, ResumesAtOtherExpertAndWorldSizesAtStage3) {
  if (is_worker()) GTEST_SKIP();
  resume_at_other_layouts(3);
}

}  // namespace
