// fp16.auto_cast and torch_autocast in one process on the CPU:
// - auto_cast: the module sees its floating-point inputs (also inside vectors and tuples) in the
//   model's 16-bit dtype, integer inputs untouched; the five real DeepSpeed configs that set it
//   train a model in fp16 with their optimizer, clipping and loss scale.
// - torch_autocast bf16: parameters and gradients stay fp32 while the Linear layers compute in
//   bf16; losses follow an fp32 run within a stated tolerance; stages 1-3 follow stage 0.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/compat.h"
#include "runtime/engine.h"
#include "runtime/error.h"

namespace {

using strata::json;

// Records the dtypes its forward receives.
struct RecorderImpl : torch::nn::Module {
  RecorderImpl() { w = register_parameter("w", torch::ones({4})); }
  torch::Tensor forward(const torch::Tensor& x, const std::vector<torch::Tensor>& list,
                        const std::tuple<torch::Tensor, int64_t>& pair, const torch::Tensor& ids) {
    seen = {x.scalar_type(), list.at(0).scalar_type(), list.at(1).scalar_type(),
            std::get<0>(pair).scalar_type(), ids.scalar_type()};
    // Element-wise ops only: fp16 runs them on the CPU (LibTorch 1.13 has no fp16 CPU matmul).
    return (x * w).sum().to(torch::kFloat) + double(std::get<1>(pair)) + ids.sum().to(torch::kFloat);
  }
  torch::Tensor w;
  std::vector<torch::ScalarType> seen;
};
TORCH_MODULE(Recorder);

json minimal_config(const json& precision) {
  json c = {{"train_micro_batch_size_per_gpu", 2},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
  c.update(precision);
  return c;
}

std::vector<torch::ScalarType> dtypes_seen(const json& precision) {
  strata::InitOptions options;
  options.allow_fp16_on_cpu = true;  // element-wise ops only
  auto engine = strata::initialize(Recorder(), minimal_config(precision), std::move(options));
  const auto x = torch::randn({4});
  auto loss = engine->forward(x, std::vector<torch::Tensor>{torch::randn({4}), torch::arange(3)},
                              std::make_tuple(torch::randn({2}), int64_t{1}), torch::arange(4));
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  EXPECT_EQ(x.scalar_type(), torch::kFloat);  // the caller's tensor is not changed
  return engine->model()->seen;
}

TEST(AutoCast, TheModuleSeesFloatingInputsInTheModelsDtype) {
  using V = std::vector<torch::ScalarType>;
  EXPECT_EQ(dtypes_seen({{"bf16", {{"enabled", true}}}, {"fp16", {{"auto_cast", true}}}}),
            (V{torch::kBFloat16, torch::kBFloat16, torch::kLong, torch::kBFloat16, torch::kLong}));
  EXPECT_EQ(dtypes_seen({{"fp16", {{"enabled", true}, {"auto_cast", true}}}}),
            (V{torch::kHalf, torch::kHalf, torch::kLong, torch::kHalf, torch::kLong}));
  // Without auto_cast the inputs arrive as passed, as in DeepSpeed.
  EXPECT_EQ(dtypes_seen({{"bf16", {{"enabled", true}}}}),
            (V{torch::kFloat, torch::kFloat, torch::kLong, torch::kFloat, torch::kLong}));
}

// A model of products and sums, which LibTorch 1.13 runs in fp16 on the CPU (its fp16 CPU matmul
// and relu are missing): y ~ sum_j w2_j * (x_j * w1_j + b1_j)^2.
struct ElementwiseImpl : torch::nn::Module {
  ElementwiseImpl() {
    torch::manual_seed(11);
    w1 = register_parameter("w1", torch::randn({8}) * 0.5);
    b1 = register_parameter("b1", torch::zeros({8}));
    w2 = register_parameter("w2", torch::randn({8}) * 0.5);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    // No .to(): with auto_cast the input arrives in the parameters' dtype.
    const auto h = x * w1 + b1;
    auto out = (h * h * w2).sum(1, true);
    return torch::mse_loss(out.to(torch::kFloat), y.to(torch::kFloat));
  }
  torch::Tensor w1, b1, w2;
};
TORCH_MODULE(Elementwise);

std::string corpus_dir() { return std::string(STRATA_SOURCE_DIR) + "/../shared/ds-configs"; }

// The real configs with fp16.auto_cast: InternVL's (ZeRO 1, 2, 3), as a Hugging Face Trainer run
// with --fp16 resolves their "auto"s.
TEST(AutoCast, TheRealConfigsWithAutoCastTrainInFp16) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(corpus_dir())) GTEST_SKIP() << "no corpus at " << corpus_dir();
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(corpus_dir())) {
    json doc = json::parse(std::ifstream(e.path()), nullptr, false);
    if (doc.is_object() && doc.contains("fp16") && doc["fp16"].value("auto_cast", false))
      files.push_back(e.path());
  }
  ASSERT_EQ(files.size(), 5u);
  for (const auto& file : files) {
    SCOPED_TRACE(file.filename().string());
    strata::InitOptions options;
    options.allow_fp16_on_cpu = true;  // Elementwise has CPU Half kernels
    options.autos.fp16 = true;
    options.autos.bf16 = false;
    options.autos.micro_batch_per_gpu = 16;
    options.autos.gradient_accumulation_steps = 1;
    options.autos.lr = 2e-2;
    options.autos.weight_decay = 0.0;
    options.autos.max_grad_norm = 1.0;
    options.autos.warmup_steps = 10;  // internvl_g's WarmupDecayLR
    options.autos.total_steps = 80;
    auto config = strata::load_engine_config(file.string(), options);
    EXPECT_TRUE(strata::pending_features(config).empty());
    ASSERT_TRUE(config.fp16.enabled && config.fp16.auto_cast);
    // internvl_g names no optimizer: the Trainer passes its AdamW, as this program does.
    if (!config.optimizer.present)
      options.optimizer_builder = [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<torch::optim::AdamW>(
            params, torch::optim::AdamWOptions(2e-2).weight_decay(0.0));
      };
    auto engine = std::make_shared<strata::ModelEngine<Elementwise>>(Elementwise(), config, options);
    EXPECT_EQ(engine->model()->w1.scalar_type(), torch::kHalf);
    EXPECT_EQ(engine->loss_scale(), std::ldexp(1.0, 32));  // initial_scale_power 32
    std::vector<double> losses;
    for (int step = 0; step < 80; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({16, 8});  // fp32: auto_cast makes it fp16
      const auto y = (x * x * torch::linspace(-1, 1, 8)).sum(1, true);
      auto loss = engine->forward(x, y);
      engine->backward(loss);
      engine->step();
      if (!engine->last_step_skipped()) losses.push_back(loss.item<double>());
    }
    // 2^32 overflows fp16 gradients: the scale falls (hysteresis 2) until steps go through.
    EXPECT_GT(engine->skipped_steps(), 10);
    EXPECT_LT(engine->loss_scale(), 65536.0);
    ASSERT_GT(losses.size(), 20u);
    double first = 0, last = 0;
    for (size_t i = 0; i < 5; ++i) first += losses[i] / 5, last += losses[losses.size() - 1 - i] / 5;
    EXPECT_LT(last, 0.5 * first) << "first " << first << ", last " << last;
    std::printf("%s (stage %lld, %s): %lld skipped, loss scale %.0f, loss %.4f -> %.4f\n",
                file.filename().c_str(), static_cast<long long>(config.zero_optimization.stage),
                config.scheduler.present ? config.scheduler.type.c_str() : "no schedule",
                static_cast<long long>(engine->skipped_steps()), engine->loss_scale(), first, last);
  }
}

// ---- torch_autocast ---------------------------------------------------------------------------

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    torch::manual_seed(5);
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
    fc2 = register_module("fc2", torch::nn::Linear(64, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = fc1(x);
    hidden_dtype = h.scalar_type();
    auto out = fc2(torch::gelu(norm(h)));
    return torch::mse_loss(out.to(torch::kFloat), y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::ScalarType hidden_dtype = torch::kFloat;
};
TORCH_MODULE(Mlp);

json autocast_config(int stage, bool autocast) {
  json c = {{"train_micro_batch_size_per_gpu", 8},
            {"gradient_accumulation_steps", 2},
            {"gradient_clipping", 1.0},
            {"steps_per_print", 1000},
            {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 500},
                                   {"stage3_param_persistence_threshold", 0}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
            {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 5}}}}}};
  if (autocast) c["torch_autocast"] = {{"enabled", true}, {"dtype", "bfloat16"}};
  return c;
}

std::vector<double> train_mlp(int stage, bool autocast, int steps = 30) {
  auto engine = strata::initialize(Mlp(), autocast_config(stage, autocast));
  std::vector<double> losses;
  for (int step = 0; step < steps * 2; ++step) {
    torch::manual_seed(500 + step);
    const auto x = torch::randn({8, 16});
    const auto y = torch::tanh(x.narrow(1, 0, 4).sum(1, true) * 0.5);
    auto loss = engine->forward(x, y);
    EXPECT_EQ(engine->model()->hidden_dtype, autocast ? torch::kBFloat16 : torch::kFloat);
    engine->backward(loss);
    engine->step();
    if (step % 2 == 1) losses.push_back(loss.item<double>());
  }
  // Parameters stay fp32; gradients of autocast's bf16 ops reach them in fp32.
  for (const auto& p : engine->model()->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  return losses;
}

TEST(TorchAutocast, Bf16FollowsFp32WithFp32Parameters) {
  const auto fp32 = train_mlp(0, false), bf16 = train_mlp(0, true);
  double worst = 0;
  for (size_t i = 0; i < fp32.size(); ++i)
    worst = std::max(worst, std::abs(bf16[i] - fp32[i]) / std::max(std::abs(fp32[i]), 1e-3));
  std::printf("torch_autocast bf16 vs fp32, 30 steps: worst relative loss difference %.4f; last "
              "loss %.5f vs %.5f\n",
              worst, bf16.back(), fp32.back());
  EXPECT_LT(worst, 0.03);  // bf16 has 8 bits of mantissa; measured 0.0095
  auto mean3 = [](const std::vector<double>& l, size_t from) { return (l[from] + l[from + 1] + l[from + 2]) / 3; };
  EXPECT_LT(mean3(bf16, bf16.size() - 3), 0.5 * mean3(bf16, 0));  // it learns
}

TEST(TorchAutocast, StagesOneToThreeFollowStageZero) {
  const auto stage0 = train_mlp(0, true);
  for (int stage : {1, 2, 3}) {
    const auto other = train_mlp(stage, true);
    double worst = 0;
    for (size_t i = 0; i < stage0.size(); ++i)
      worst = std::max(worst, std::abs(other[i] - stage0[i]) / std::max(std::abs(stage0[i]), 1e-3));
    std::printf("torch_autocast bf16 stage %d vs stage 0: worst relative loss difference %.2e\n",
                stage, worst);
    // One process: same fp32 gradients, same AdamW; only summation order may differ.
    EXPECT_LT(worst, 1e-4) << "stage " << stage;
  }
}

// DeepSpeed's lower_precision_safe_modules: by default Linear and Conv (here fc1, fc2), named
// as DeepSpeed names them or by LibTorch's name().
TEST(TorchAutocast, LowerPrecisionSafeModulesFindTheirParameters) {
  Mlp mlp;
  strata::TorchAutocastConfig config;
  const auto by_default = strata::lower_precision_safe_parameters(*mlp, config);
  ASSERT_EQ(by_default.size(), 4u);
  EXPECT_TRUE(by_default[0].is_same(mlp->fc1->weight));
  config.lower_precision_safe_modules = std::vector<std::string>{"torch.nn.LayerNorm", "torch::nn::Conv2dImpl"};
  std::vector<std::string> unmatched;
  const auto norms = strata::lower_precision_safe_parameters(*mlp, config, &unmatched);
  ASSERT_EQ(norms.size(), 2u);
  EXPECT_TRUE(norms[0].is_same(mlp->norm->weight));
  EXPECT_EQ(unmatched, std::vector<std::string>{"torch::nn::Conv2dImpl"});
}

TEST(TorchAutocast, AutocastTheProgramTurnedOnIsOffUnlessTheConfigAsks) {
  auto engine = strata::initialize(Mlp(), autocast_config(0, false));
  strata::compat::set_autocast_dtype(c10::DeviceType::CPU, torch::kBFloat16);
  strata::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
  engine->forward(torch::randn({8, 16}), torch::randn({8, 1}));
  EXPECT_EQ(engine->model()->hidden_dtype, torch::kFloat);  // DeepSpeed's engine does the same
  EXPECT_TRUE(strata::compat::autocast_enabled(c10::DeviceType::CPU));  // restored after
  strata::compat::set_autocast_enabled(c10::DeviceType::CPU, false);
}

TEST(TorchAutocast, RefusedWhereItCannotRun) {
  if (!strata::compat::kCpuAutocastHasFp16) {
    json c = autocast_config(0, false);
    c["torch_autocast"] = {{"enabled", true}, {"dtype", "float16"}};
    try {
      strata::initialize(Mlp(), c);
      ADD_FAILURE() << "fp16 autocast on the CPU of LibTorch < 2.4 should be refused";
    } catch (const strata::Error& e) {
      EXPECT_NE(std::string(e.what()).find("bfloat16 only"), std::string::npos) << e.what();
    }
  }
}

// DeepSpeed's bf16 example (bf16_master_weight/configs) runs autocast over bf16 parameters: the
// model is cast as bf16 says, the forward runs under autocast, and training follows fp32.
TEST(TorchAutocast, OverBf16ParametersAsDeepSpeedsExample) {
  json c = autocast_config(0, true);
  c["bf16"] = {{"enabled", true}};
  auto engine = strata::initialize(Mlp(), c);
  for (const auto& p : engine->model()->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  torch::manual_seed(1);
  const auto x = torch::randn({8, 16});
  auto loss = engine->forward(x, torch::sin(x.sum(1, true)));
  EXPECT_EQ(engine->model()->hidden_dtype, torch::kBFloat16);
  engine->backward(loss);
  engine->step();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
}

}  // namespace
