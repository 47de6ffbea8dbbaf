// offload_optimizer.super_offload on a GPU (zero/speculative_step.h): the speculative CPU step,
// begun during backward as the gradients land in host memory, leaves the fp32 master, both Adam
// moments and the model's weights bit for bit where the synchronous offloaded step leaves them,
// after every step of a run with an fp16 overflow (the step skipped: the speculation dropped),
// steps where clipping applies (redone) and steps where it does not (kept); fp16 and bf16, stages
// 1-3, gradient accumulation 2. fp16 here only: LibTorch's CPU kernels lack its products.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "examples/gpt.h"
#include "runtime/engine.h"
#include "runtime/optim/state_io.h"

namespace {

#if STRATA_TEST_HAS_CUDA
struct Run {
  std::vector<std::vector<torch::Tensor>> states;  // per step: master, moments, model weights
  std::vector<double> norms;
  int64_t skipped = 0, speculated = 0, redone = 0;
};

Run train(int64_t stage, const std::string& precision, double clip, bool speculative) {
  using namespace strata::examples;
  const torch::Device device(torch::kCUDA, 0);
  const auto cfg = GPTConfig::by_name("tiny");
  torch::manual_seed(3);
  GPT model(cfg);
  model->to(device);
  nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", 4},
      {"gradient_accumulation_steps", 2},
      {"steps_per_print", 1000000},
      {"gradient_clipping", clip},
      {"zero_optimization",
       {{"stage", stage},
        {"reduce_bucket_size", 20000},
        {"sub_group_size", 7000},
        {"stage3_param_persistence_threshold", 0},
        {"offload_optimizer", {{"device", "cpu"}, {"super_offload", speculative}}}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.1}}}}}};
  if (precision == "fp16")
    config["fp16"] = {{"enabled", true}, {"initial_scale_power", 12}, {"hysteresis", 1}};
  else
    config["bf16"] = {{"enabled", true}};
  auto engine = strata::initialize(model, config);
  const auto options = torch::TensorOptions().dtype(torch::kLong).device(device);
  Run run;
  for (int64_t step = 0; step < 6; ++step) {
    for (int64_t micro = 0; micro < 2; ++micro) {
      const auto tokens = torch::randint(0, cfg.vocab, {4, cfg.seq_len}, options);
      const auto targets = torch::randint(0, cfg.vocab, {4, cfg.seq_len}, options);
      auto loss = engine->forward(tokens, targets);
      if (step == 2 && micro == 1) loss = loss * std::numeric_limits<float>::infinity();
      engine->backward(loss);
      engine->step();
    }
    run.norms.push_back(engine->last_grad_norm());
    auto& optimizer = engine->optimizer();  // waits for a step still running
    std::vector<torch::Tensor> state;
    for (const auto& p : optimizer.param_groups()[0].params()) {
      state.push_back(p.detach().cpu().clone());
      if (const auto s = strata::optim::export_param_state(optimizer, p))
        for (const auto& [name, t] : s->tensors) state.push_back(t.detach().cpu().clone());
    }
    for (const auto& p : model->parameters())
      if (p.numel() > 0) state.push_back(p.detach().cpu().clone());
    run.states.push_back(std::move(state));
  }
  run.skipped = engine->skipped_steps();
  if (const auto* t = engine->last_offload_times()) run.speculated = t->speculated, run.redone = t->redone;
  return run;
}
#endif

TEST(EngineGpuSpeculative, Fp16OverflowAndClippingGiveTheSynchronousStepBitForBit) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const std::string precision : {"fp16", "bf16"})
    for (int64_t stage : {1, 2, 3}) {
      const std::string what = precision + " stage " + std::to_string(stage);
      // A clipping threshold some steps' norms pass and others do not: the median.
      auto norms = train(stage, precision, 0.0, false).norms;
      norms.erase(std::remove_if(norms.begin(), norms.end(), [](double n) { return !std::isfinite(n); }),
                  norms.end());
      ASSERT_FALSE(norms.empty()) << what;
      std::sort(norms.begin(), norms.end());
      const double clip = norms[norms.size() / 2];
      const auto sync = train(stage, precision, clip, false);
      const auto spec = train(stage, precision, clip, true);
      if (precision == "fp16") {
        EXPECT_EQ(sync.skipped, 1) << what;
        EXPECT_EQ(spec.skipped, 1) << what;
      }
      EXPECT_EQ(spec.speculated, 6) << what;
      EXPECT_GT(spec.redone, precision == "fp16" ? 1 : 0) << what << ": nothing clipped";
      EXPECT_LT(spec.redone, 6) << what << ": every speculation redone";
      ASSERT_EQ(sync.states.size(), spec.states.size());
      for (size_t s = 0; s < sync.states.size(); ++s) {
        ASSERT_EQ(sync.states[s].size(), spec.states[s].size()) << what;
        for (size_t i = 0; i < sync.states[s].size(); ++i)
          EXPECT_TRUE(torch::equal(sync.states[s][i], spec.states[s][i]))
              << what << ", step " << s + 1 << ", tensor " << i;
      }
    }
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

}  // namespace
