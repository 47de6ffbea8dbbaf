// The engine's hot path on a GPU asks the host to wait for the device once per optimizer step
// (the overflow flag and gradient norm, PartitionedOptimizer::prepare) and nowhere else: LibTorch's
// sync debug mode reports every synchronizing CUDA operation as a warning, and the test counts
// them over steps of bf16 training at ZeRO stages 0 and 2, with and without gradient accumulation.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "examples/gpt.h"
#include "runtime/engine.h"
#include "tests/cuda_sync_counter.h"

namespace {

#if STRATA_TEST_HAS_CUDA
using strata::test_support::count_syncs;

// Host syncs per optimizer step of the tiny GPT in bf16 at `stage` with `gas` micro-steps.
double syncs_per_step(int64_t stage, int64_t gas) {
  using namespace strata::examples;
  const torch::Device device(torch::kCUDA, 0);
  const auto cfg = GPTConfig::by_name("tiny");
  torch::manual_seed(0);
  GPT model(cfg);
  model->to(device);
  nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", 8}, {"gradient_accumulation_steps", gas},
      {"steps_per_print", 1000000}, {"gradient_clipping", 1.0}, {"bf16", {{"enabled", true}}},
      {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 20000}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
  auto engine = strata::initialize(model, config);
  const auto options = torch::TensorOptions().dtype(torch::kLong).device(device);
  const auto tokens = torch::randint(0, cfg.vocab, {8, cfg.seq_len}, options);
  const auto targets = torch::randint(0, cfg.vocab, {8, cfg.seq_len}, options);
  auto step = [&] {
    for (int64_t m = 0; m < gas; ++m) {
      auto loss = engine->forward(tokens, targets);
      engine->backward(loss);
      engine->step();
    }
  };
  step();
  step();  // warm: lazily created state, allocator
  const int steps = 5;
  const int syncs = count_syncs([&] {
    for (int i = 0; i < steps; ++i) step();
  });
  return double(syncs) / steps;
}
#endif

TEST(EngineGpuSync, OneHostSyncPerOptimizerStep) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (int64_t stage : {0, 2})
    for (int64_t gas : {1, 2}) {
      const double syncs = syncs_per_step(stage, gas);
      std::cout << "[ INFO     ] stage " << stage << ", gas " << gas << ": " << syncs
                << " host syncs per step\n";
      EXPECT_EQ(syncs, 1.0) << "stage " << stage << ", gradient_accumulation_steps " << gas;
    }
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

}  // namespace
