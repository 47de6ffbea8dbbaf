// Mixed precision and ZeRO stages 1-2 in one process: fp32 stages 1 and 2 must equal LibTorch's
// AdamW on the same model and data; bf16 keeps 16-bit parameters with fp32 master weights and
// tracks fp32; fp16 skips an overflowing step exactly as DeepSpeed does.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "runtime/engine.h"
#include "runtime/error.h"
#include "tests/runtime/engine/speculative_run.h"
#include "tests/sanitized.h"

namespace {

using strata::json;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto out = fc2(torch::tanh(fc1(x.to(fc1->weight.scalar_type()))));
    return torch::mse_loss(out.to(torch::kFloat), y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

std::pair<Net, Net> twin_nets() {
  torch::manual_seed(3);
  Net a, b;
  torch::NoGradGuard no_grad;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  return {a, b};
}

struct Batch {
  torch::Tensor x, y;
};
Batch batch(int64_t step, int64_t n) {
  torch::manual_seed(77 + step);
  auto x = torch::randn({n, 8});
  return {x, x.sum(1, true).sin()};
}

json config_for(int64_t stage, int64_t gas) {
  return {{"train_micro_batch_size_per_gpu", 16 / gas},
          {"gradient_accumulation_steps", gas},
          {"steps_per_print", 1000},
          {"gradient_clipping", 0.5},
          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 200}}},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
}

class ZeroStagesFp32 : public testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZeroStagesFp32, MatchLibTorchAdamWWithClipping) {
  const auto [stage, gas] = GetParam();
  auto [net, ref] = twin_nets();
  auto engine = strata::initialize(net, config_for(stage, gas));
  torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  const int64_t micro = 16 / gas;
  for (int64_t step = 0; step < 12; ++step) {
    const auto d = batch(step, 16);
    for (int64_t m = 0; m < gas; ++m) {
      engine->backward(engine->forward(d.x.narrow(0, m * micro, micro),
                                       d.y.narrow(0, m * micro, micro)));
      engine->step();
    }
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    opt.step();
    EXPECT_NEAR(engine->last_grad_norm(), norm, 1e-5 * norm) << "step " << step;
    auto pn = net->parameters(), pr = ref->parameters();
    for (size_t i = 0; i < pn.size(); ++i)
      ASSERT_TRUE(torch::allclose(pn[i], pr[i], 1e-5, 1e-6))
          << "stage " << stage << " step " << step << " parameter " << i;
  }
  // The module's own tensors were trained in place (views into the flat buffer).
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kFloat);
}

INSTANTIATE_TEST_SUITE_P(StageAndAccumulation, ZeroStagesFp32,
                         testing::Combine(testing::Values(1, 2), testing::Values(1, 2)));

TEST(MixedPrecision, Bf16KeepsSixteenBitParametersAndTracksFp32) {
  auto [net, ref] = twin_nets();
  auto config = config_for(0, 1);
  config["bf16"] = {{"enabled", true}};
  auto engine = strata::initialize(net, config);
  auto fp32 = strata::initialize(ref, config_for(0, 1));
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kBFloat16);
  double worst = 0;
  for (int64_t step = 0; step < 30; ++step) {
    const auto d = batch(step, 16);
    auto loss = engine->forward(d.x, d.y);
    auto loss32 = fp32->forward(d.x, d.y);
    worst = std::max(worst, std::abs(loss.item<double>() - loss32.item<double>()) /
                                loss32.item<double>());
    engine->backward(loss);
    engine->step();
    fp32->backward(loss32);
    fp32->step();
  }
  EXPECT_LT(worst, 0.05) << "bf16 drifted from fp32 by " << worst;
  // Master weights and Adam state are fp32 over the flat partition: 4 + 8 bytes per parameter,
  // the 16-bit parameters and gradients 2 + 2.
  const auto bytes = engine->model_state_bytes();
  EXPECT_EQ(bytes.params, bytes.grads);
  EXPECT_EQ(bytes.master, 2 * bytes.params);
  EXPECT_EQ(bytes.optimizer, 4 * bytes.params);
}

// Elementwise only: LibTorch's CPU kernels have no fp16 matrix product (GPUs do).
struct ScaleNetImpl : torch::nn::Module {
  ScaleNetImpl() {
    w = register_parameter("w", torch::randn({8}));
    b = register_parameter("b", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto out = (x.to(w.scalar_type()) * w).sum(1, true) + b;
    return torch::mse_loss(out.to(torch::kFloat), y);
  }
  torch::Tensor w, b;
};
TORCH_MODULE(ScaleNet);

// ScaleNet's ops have CPU Half kernels: the engine lets fp16 run on the CPU when told so.
strata::InitOptions cpu_fp16() {
  strata::InitOptions options;
  options.allow_fp16_on_cpu = true;
  return options;
}

// fp16 with a hysteresis of 1: an overflowing step changes nothing but halves the scale.
TEST(MixedPrecision, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  torch::manual_seed(5);
  ScaleNet net;
  auto config = config_for(1, 1);
  config["fp16"] = {{"enabled", true}, {"initial_scale_power", 10}, {"hysteresis", 1}};
  config["scheduler"] = {{"type", "WarmupLR"},
                         {"params", {{"warmup_max_lr", 1e-2}, {"warmup_num_steps", 10}}}};
  auto engine = strata::initialize(net, config, cpu_fp16());
  EXPECT_EQ(engine->loss_scale(), 1024.0);
  for (int64_t step = 0; step < 6; ++step) {
    const auto d = batch(step, 16);
    auto loss = engine->forward(d.x, d.y);
    const bool poison = step == 3;
    if (poison) loss = loss * std::numeric_limits<float>::infinity();
    const auto before = net->w.detach().clone();
    const auto lr_before = engine->get_lr();
    const auto sched_before = engine->lr_scheduler()->last_batch_iteration();
    const double scale_before = engine->loss_scale();
    engine->backward(loss);
    engine->step();
    EXPECT_EQ(engine->last_step_skipped(), poison) << "step " << step;
    if (poison) {
      EXPECT_TRUE(torch::equal(net->w.detach(), before));
      EXPECT_EQ(engine->get_lr(), lr_before);
      EXPECT_EQ(engine->lr_scheduler()->last_batch_iteration(), sched_before);
      EXPECT_EQ(engine->loss_scale(), scale_before / 2);
    } else if (step >= 2) {  // WarmupLR's first two steps run at warmup_min_lr = 0
      EXPECT_FALSE(torch::equal(net->w.detach(), before)) << "step " << step;
    }
  }
  EXPECT_EQ(engine->skipped_steps(), 1);
  EXPECT_EQ(engine->global_steps(), 6);
}

// Optimizer offload to CPU memory steps the same numbers as the step beside the model: fp16 with
// a poisoned (skipped) step, clipping, at stages 1-3, through Strata's flat Adam (tiles of 3
// elements) and through an ordinary optimizer (SGD with momentum); gradient accumulation 2 (fp32
// sums on the host, the norm on the host) and 1 (at stages 2-3 the norm summed on the device).
class OffloadedOptimizer : public testing::TestWithParam<std::tuple<int, std::string, int>> {};

TEST_P(OffloadedOptimizer, StepsLikeTheDeviceStep) {
  const auto [stage, optimizer, gas] = GetParam();
  std::vector<torch::Tensor> finals[2];
  for (bool offload : {false, true}) {
    torch::manual_seed(5);
    ScaleNet net;
    auto config = config_for(stage, gas);
    config["fp16"] = {{"enabled", true}, {"initial_scale_power", 10}, {"hysteresis", 1}};
    if (optimizer == "SGD")
      config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 1e-2}, {"momentum", 0.9}}}};
    config["zero_optimization"]["sub_group_size"] = 3;
    if (offload) config["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    auto engine = strata::initialize(net, config, cpu_fp16());
    for (int64_t micro = 0; micro < 6 * gas; ++micro) {
      const auto d = batch(micro, 16 / gas);
      auto loss = engine->forward(d.x, d.y);
      if (micro == 2 * gas + 1 - (gas == 1)) loss = loss * std::numeric_limits<float>::infinity();
      engine->backward(loss);
      engine->step();
    }
    EXPECT_EQ(engine->skipped_steps(), 1);
    EXPECT_EQ(engine->optimizer().param_groups()[0].params()[0].device().type(), torch::kCPU);
    for (const auto& p : net->parameters()) finals[offload].push_back(p.detach().to(torch::kFloat));
  }
  for (size_t i = 0; i < finals[0].size(); ++i)
    EXPECT_TRUE(torch::allclose(finals[0][i], finals[1][i], 1e-6, 1e-7))
        << "parameter " << i << " differs by " << (finals[0][i] - finals[1][i]).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(Stages, OffloadedOptimizer,
                         testing::Combine(testing::Values(1, 2, 3), testing::Values("AdamW", "SGD"),
                                          testing::Values(1, 2)));

// offload_optimizer.super_offload, in one process on the CPU: the speculative step's state equals
// the synchronous step's bit for bit after every step, with an fp16 overflow (Half kernels on the
// CPU for this model only) or a huge loss, and clipping at some steps (speculative_run.h).
TEST(OffloadedOptimizer, SpeculativeStepEqualsTheSynchronousStepBitForBit) {
  for (const std::string precision : {"fp16", "bf16", "fp32"})
    for (int64_t stage : {1, 2, 3}) {
      // Under a sanitizer (CI's time): each precision at one stage, each stage once.
      if (strata::test::kSanitized && stage != (precision == "fp16" ? 2 : precision == "bf16" ? 3 : 1))
        continue;
      speculative_run::expect_speculation_exact(torch::kCPU, stage, precision, cpu_fp16());
    }
}

TEST(MixedPrecision, ClientOptimizerInstanceIsRefusedWithZero) {
  auto [net, ref] = twin_nets();
  auto config = config_for(1, 1);
  config.erase("optimizer");
  strata::InitOptions options;
  options.optimizer = std::make_shared<torch::optim::SGD>(net->parameters(),
                                                          torch::optim::SGDOptions(0.1));
  EXPECT_THROW(strata::initialize(net, config, options), strata::Error);
  options.optimizer = nullptr;
  options.optimizer_builder = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
  };
  auto engine = strata::initialize(net, config, options);
  EXPECT_EQ(engine->optimizer().param_groups()[0].params()[0].scalar_type(), torch::kFloat);
}

}  // namespace
