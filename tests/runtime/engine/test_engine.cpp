// The engine at stage 0 against LibTorch's own optimizers on the same model and data, plus the
// plug-in points: registered optimizers and schedulers, client optimizer and scheduler.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/util/tiled.h"
#include "runtime/optim/registry.h"
#include "runtime/sched/registry.h"

namespace {

using strata::json;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(fc2(torch::tanh(fc1(x))), y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

// Two nets with identical parameters.
std::pair<Net, Net> twin_nets() {
  torch::manual_seed(7);
  Net a, b;
  torch::NoGradGuard no_grad;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  return {a, b};
}

struct Data {
  torch::Tensor x, y;
};
Data batch(int64_t step, int64_t n) {
  torch::manual_seed(1000 + step);
  auto x = torch::randn({n, 8});
  return {x, x.sum(1, true).sin()};
}

void expect_same_params(Net& a, Net& b, double rtol, const std::string& where) {
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::allclose(pa[i], pb[i], rtol, 1e-7))
        << where << ": parameter " << i << " differs by "
        << (pa[i] - pb[i]).abs().max().item<double>();
}

json base_config(int64_t micro, int64_t gas) {
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", gas},
          {"steps_per_print", 1000000}};
}

TEST(EngineStage0, AdamWMatchesLibTorchAdamW) {
  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["optimizer"] = {{"type", "AdamW"},
                         {"params", {{"lr", 1e-2}, {"betas", {0.9, 0.99}}, {"weight_decay", 0.1}}}};
  auto engine = strata::initialize(net, config);
  torch::optim::AdamW opt(ref->parameters(),
                          torch::optim::AdamWOptions(1e-2).betas({0.9, 0.99}).weight_decay(0.1));
  for (int64_t step = 0; step < 20; ++step) {
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    opt.step();
    expect_same_params(net, ref, 1e-5, "step " + std::to_string(step));
  }
  EXPECT_EQ(engine->global_steps(), 20);
}

// A parameter the forward never uses steps on a zero gradient at every stage (DeepSpeed's
// rule; Strata's reducer and flat partitions fill zeros): AdamW's decay shrinks it by
// (1 - lr * wd) per step, in one process at stage 0 (where LibTorch 2 would skip its None
// gradient) as at stage 2. Found by the differential matrix (tiny-zoo, stage 0 vs stage 2).
struct WithUnusedImpl : torch::nn::Module {
  WithUnusedImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 1));
    unused = register_module("unused", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(fc(x), y);
  }
  torch::nn::Linear fc{nullptr}, unused{nullptr};
};
TORCH_MODULE(WithUnused);

TEST(EngineStage0, AnUnusedParameterStepsOnAZeroGradientAtEveryStage) {
  std::vector<torch::Tensor> finals;
  for (int stage : {0, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    torch::manual_seed(3);
    WithUnused net;
    const auto start = net->unused->weight.detach().clone();
    auto config = base_config(16, 1);
    config["zero_optimization"] = {{"stage", stage}};
    config["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}};
    auto engine = strata::initialize(net, config);
    for (int64_t step = 0; step < 3; ++step) {
      auto d = batch(step, 16);
      engine->backward(engine->forward(d.x, d.y));
      engine->step();
    }
    auto gathered = engine->gathered_parameters();
    const auto decayed = start * std::pow(1.0 - 1e-2 * 0.1, 3);
    EXPECT_TRUE(torch::allclose(net->unused->weight, decayed, 1e-6, 1e-9))
        << (net->unused->weight - decayed).abs().max().item<double>();
    finals.push_back(net->fc->weight.detach().clone());
  }
  EXPECT_TRUE(torch::allclose(finals[0], finals[1], 1e-5, 1e-7));
}

TEST(EngineStage0, AdamWithL2MatchesLibTorchAdam) {
  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["optimizer"] = {{"type", "Adam"},
                         {"params", {{"lr", 5e-3}, {"adam_w_mode", false}, {"weight_decay", 0.05}}}};
  auto engine = strata::initialize(net, config);
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(5e-3).weight_decay(0.05));
  for (int64_t step = 0; step < 20; ++step) {
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    opt.step();
  }
  expect_same_params(net, ref, 1e-5, "after 20 steps");
}

TEST(EngineStage0, SgdMomentumNesterovMatchesLibTorchSgd) {
  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["optimizer"] = {
      {"type", "SGD"},
      {"params", {{"lr", 0.05}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 1e-3}}}};
  auto engine = strata::initialize(net, config);
  torch::optim::SGD opt(ref->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
  for (int64_t step = 0; step < 20; ++step) {
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    opt.step();
    expect_same_params(net, ref, 1e-5, "step " + std::to_string(step));
  }
}

// Four micro-batches of 4 accumulate to the same update as one batch of 16 (mean losses).
// SGD with momentum: its update is linear in the gradient, so float rounding in the sum stays
// at float level (Adam's first step, g / (|g| + eps), amplifies it for gradients near eps).
TEST(EngineStage0, GradientAccumulationEqualsTheFullBatch) {
  auto [net, ref] = twin_nets();
  auto config = base_config(4, 4);
  config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.05}, {"momentum", 0.9}}}};
  auto engine = strata::initialize(net, config);
  EXPECT_EQ(engine->train_batch_size(), 16);
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < 10; ++step) {
    auto d = batch(step, 16);
    for (int64_t m = 0; m < 4; ++m) {
      EXPECT_EQ(engine->is_gradient_accumulation_boundary(), m == 3);
      engine->backward(engine->forward(d.x.narrow(0, 4 * m, 4), d.y.narrow(0, 4 * m, 4)));
      engine->step();
    }
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    opt.step();
    expect_same_params(net, ref, 1e-5, "step " + std::to_string(step));
  }
  EXPECT_EQ(engine->global_steps(), 10);
  EXPECT_EQ(engine->micro_steps(), 40);
}

// One process through the partitioned optimizer (stage 1 here; stage 0 under bf16/fp16): each
// gradient is written into the flat buffer as autograd delivers it (copied on a window's first
// micro-step, added after). The program still sees .grad as autograd's sum after each backward
// (a view of the flat buffer), and none after the step. (Plain fp32 stage 0 optimizes the
// module's own tensors: autograd's .grad as it is.)
TEST(EngineStage0, GradAfterBackwardIsTheWindowsSumAndNoneAfterTheStep) {
  for (const int64_t stage : {1}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto [net, ref] = twin_nets();
    auto config = base_config(4, 2);
    config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.05}}}};
    config["zero_optimization"] = {{"stage", stage}};
    auto engine = strata::initialize(net, config);
    for (int64_t step = 0; step < 3; ++step) {
      auto d = batch(step, 8);
      for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
      for (int64_t m = 0; m < 2; ++m) {
        const auto x = d.x.narrow(0, 4 * m, 4), y = d.y.narrow(0, 4 * m, 4);
        engine->backward(engine->forward(x, y));
        (ref->forward(x, y) / 2).backward();  // the engine divides by the accumulation steps
        const auto got = net->parameters(), want = ref->parameters();
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_TRUE(got[i].grad().defined()) << "micro-step " << m << ", parameter " << i;
          EXPECT_TRUE(torch::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-7))
              << "micro-step " << m << ", parameter " << i;
        }
        engine->step();
      }
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
      torch::NoGradGuard no_grad;
      for (auto& p : ref->parameters()) p.sub_(p.grad(), 0.05);
      expect_same_params(net, ref, 1e-5, "step " + std::to_string(step));
    }
  }
}

TEST(EngineStage0, GradientClippingMatchesClipGradNorm) {
  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["gradient_clipping"] = 0.05;
  config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.1}}}};
  auto engine = strata::initialize(net, config);
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int64_t step = 0; step < 10; ++step) {
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05);
    opt.step();
    EXPECT_NEAR(engine->last_grad_norm(), norm, 1e-5 * norm);
    expect_same_params(net, ref, 1e-5, "step " + std::to_string(step));
  }
}

// DeepSpeed's WarmupLR (linear): lr(i) = min + (max - min) * min(i, warmup) / warmup for the
// scheduler's iteration i. As in DeepSpeed, the scheduler starts at i = -1 (lr = min) and steps
// after each optimizer step, so optimizer step s (counting from 0) runs with lr(s - 1).
TEST(EngineStage0, ConfiguredSchedulerDrivesTheOptimizer) {
  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.1}}}};
  config["scheduler"] = {{"type", "WarmupLR"},
                         {"params",
                          {{"warmup_min_lr", 0.0},
                           {"warmup_max_lr", 0.1},
                           {"warmup_num_steps", 10},
                           {"warmup_type", "linear"}}}};
  auto engine = strata::initialize(net, config);
  // Replay with LibTorch's SGD at DeepSpeed's lr for each step.
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int64_t step = 0; step < 15; ++step) {
    const int64_t iteration = std::max<int64_t>(step - 1, 0);
    const double expected = 0.1 * std::min<int64_t>(iteration, 10) / 10.0;
    EXPECT_NEAR(engine->get_lr().at(0), expected, 1e-12) << "step " << step;
    static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).lr(expected);
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    opt.step();
  }
  expect_same_params(net, ref, 1e-5, "after 15 steps");
}

TEST(EnginePlugins, ClientOptimizerIsUsedWhenTheConfigNamesNone) {
  auto [net, ref] = twin_nets();
  auto client = std::make_shared<torch::optim::SGD>(net->parameters(),
                                                    torch::optim::SGDOptions(0.2).momentum(0.5));
  strata::InitOptions options;
  options.optimizer = client;
  auto engine = strata::initialize(net, base_config(16, 1), options);
  EXPECT_EQ(&engine->optimizer(), client.get());
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.2).momentum(0.5));
  for (int64_t step = 0; step < 5; ++step) {
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    engine->step();
    opt.zero_grad();
    ref->forward(d.x, d.y).backward();
    opt.step();
  }
  expect_same_params(net, ref, 1e-6, "client optimizer");
}

TEST(EnginePlugins, ClientOptimizerAndConfigOptimizerTogetherIsAnError) {
  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}};
  strata::InitOptions options;
  options.optimizer_builder = [](std::vector<torch::Tensor> params) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  };
  try {
    strata::initialize(net, config, options);
    FAIL() << "expected strata::Error";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer"), std::string::npos) << e.what();
  }
}

TEST(EnginePlugins, NoOptimizerAnywhereIsAnError) {
  auto [net, ref] = twin_nets();
  EXPECT_THROW(strata::initialize(net, base_config(16, 1)), strata::Error);
}

// A registered optimizer: sign descent, p -= lr * sign(g). Its update is distinguishable from
// every built-in's.
class SignSgd : public torch::optim::Optimizer {
 public:
  SignSgd(std::vector<torch::Tensor> params, double lr)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<torch::optim::SGDOptions>(lr)) {}
  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const double lr = group.options().get_lr();
      for (auto& p : group.params())
        if (p.grad().defined()) p.add_(p.grad().sign(), -lr);
    }
    return {};
  }
};

TEST(EnginePlugins, RegisteredOptimizerAndSchedulerAreUsedByName) {
  strata::register_optimizer("test_signsgd", [](std::vector<torch::Tensor> params,
                                                 const json& cfg) {
    return std::make_unique<SignSgd>(std::move(params), cfg.at("lr").get<double>());
  });
  // A scheduler that halves the lr at every iteration: lr(i) = 0.1 * 0.5^max(i, 0).
  class Halving : public strata::LRScheduler {
   public:
    explicit Halving(torch::optim::Optimizer& optimizer) : LRScheduler(optimizer) { start(-1); }
    std::vector<double> get_lr() const override {
      return {0.1 * std::pow(0.5, double(std::max<int64_t>(last_batch_iteration_, 0)))};
    }
  };
  strata::register_scheduler("test_halving", [](torch::optim::Optimizer& opt, const json&) {
    return std::make_unique<Halving>(opt);
  });

  auto [net, ref] = twin_nets();
  auto config = base_config(16, 1);
  config["optimizer"] = {{"type", "test_signsgd"}, {"params", {{"lr", 0.1}}}};
  config["scheduler"] = {{"type", "test_halving"}, {"params", json::object()}};
  auto engine = strata::initialize(net, config);
  EXPECT_NE(dynamic_cast<SignSgd*>(&engine->optimizer()), nullptr);
  for (int64_t step = 0; step < 4; ++step) {
    const double lr = engine->get_lr().at(0);
    auto before = net->fc1->weight.detach().clone();
    auto d = batch(step, 16);
    engine->backward(engine->forward(d.x, d.y));
    auto grad_sign = net->fc1->weight.grad().sign();
    engine->step();
    EXPECT_TRUE(torch::allclose(net->fc1->weight.detach(), before - lr * grad_sign, 0, 1e-7));
    EXPECT_NEAR(engine->get_lr().at(0), 0.1 * std::pow(0.5, double(step)), 1e-12);
  }
}

// Parameter offload alone (DeepSpeed allows it at stage 3): the 16-bit shards in host memory
// or an NVMe swap file, the fp32 master and AdamW's moments on the model's device; each step
// stores the new master, cast, where the shards live (ParamUnits::store_partition). The losses of
// the same run without offload, over 2 micro-steps per step; the swap folder empty afterwards.
TEST(EngineConfig, ParameterOffloadWithTheOptimizerOnTheDeviceTrainsAsWithout) {
  const auto swap = std::filesystem::path(STRATA_BIN_DIR) / ".." /
                    ("engine-param-offload-" + std::to_string(getpid()));
  std::filesystem::create_directories(swap);
  auto losses = [&](const std::string& device) {
    auto [net, unused] = twin_nets();
    auto config = base_config(8, 2);
    config["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}};
    config["zero_optimization"] = {{"stage", 3}, {"stage3_param_persistence_threshold", 0}};
    if (device != "none") config["zero_optimization"]["offload_param"] = {{"device", device}};
    if (device == "nvme") config["zero_optimization"]["offload_param"]["nvme_path"] = swap.string();
    auto engine = strata::initialize(net, config);
    EXPECT_EQ(engine->optimizer_swapper(), nullptr);
    std::vector<double> out;
    for (int64_t step = 0; step < 8; ++step) {
      auto d = batch(step, 8);
      auto loss = engine->forward(d.x, d.y);
      out.push_back(loss.item<double>());
      engine->backward(loss);
      engine->step();
    }
    return out;
  };
  const auto reference = losses("none");
  for (const std::string device : {"cpu", "nvme"}) {
    const auto offloaded = losses(device);
    ASSERT_EQ(offloaded.size(), reference.size());
    for (size_t i = 0; i < reference.size(); ++i)
      EXPECT_NEAR(offloaded[i], reference[i], 1e-6 * std::abs(reference[i]))
          << "offload_param " << device << ", micro-step " << i;
    EXPECT_TRUE(std::filesystem::is_empty(swap)) << device;
  }
  std::filesystem::remove(swap);  // empty (checked above)
}

TEST(EngineConfig, AutoValuesComeFromTheProgram) {
  auto [net, ref] = twin_nets();
  json config = {{"train_batch_size", "auto"},
                 {"train_micro_batch_size_per_gpu", "auto"},
                 {"gradient_accumulation_steps", "auto"},
                 {"steps_per_print", 1000000},
                 {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}}}}}};
  strata::InitOptions options;
  options.autos.micro_batch_per_gpu = 4;
  options.autos.gradient_accumulation_steps = 2;
  options.autos.lr = 0.0123;
  auto engine = strata::initialize(net, config, options);
  EXPECT_EQ(engine->train_batch_size(), 8);
  EXPECT_DOUBLE_EQ(engine->get_lr().at(0), 0.0123);
}

}  // namespace

namespace {

// The config's monitors get the engine's events at every optimizer step, x axis = samples.
TEST(EngineMonitors, CsvAndTensorBoardReceiveTheTrainingScalars) {
  auto [net, ref] = twin_nets();
  const std::string dir = testing::TempDir() + "/engine_monitors_" + std::to_string(getpid());
  auto config = base_config(8, 2);
  config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 0.05}}}};
  config["csv_monitor"] = {{"enabled", true}, {"output_path", dir}, {"job_name", "run"}};
  config["tensorboard"] = {{"enabled", true}, {"output_path", dir}, {"job_name", "tb"}};
  auto engine = strata::initialize(net, config);
  std::vector<double> losses;
  for (int64_t step = 0; step < 4; ++step) {
    auto d = batch(step, 16);
    double sum = 0;
    for (int64_t m = 0; m < 2; ++m) {
      auto loss = engine->forward(d.x.narrow(0, 8 * m, 8), d.y.narrow(0, 8 * m, 8));
      sum += loss.item<double>();
      engine->backward(loss);
      engine->step();
    }
    losses.push_back(sum / 2);
  }
  std::ifstream csv(dir + "/run/Train_Samples_train_loss.csv");
  ASSERT_TRUE(csv.good());
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line.rfind("step,", 0), 0u) << line;
  for (size_t i = 0; i < losses.size(); ++i) {
    ASSERT_TRUE(std::getline(csv, line));
    const auto comma = line.find(',');
    EXPECT_EQ(std::stoll(line.substr(0, comma)), int64_t(16 * (i + 1)));
    EXPECT_NEAR(std::stod(line.substr(comma + 1)), losses[i], 1e-6);
  }
  bool event_file = false;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/tb"))
    event_file |= e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_TRUE(event_file);
  EXPECT_TRUE(std::ifstream(dir + "/run/Train_Samples_lr.csv").good());
}

}  // namespace

// activation_checkpointing.mlp_tiles is the model's to act on: a model that makes no tiled call
// in its first forward gets one warning after the first backward (the key never does nothing
// silently), and a model that tiles gets none.
TEST(EngineConfig, MlpTilesTheModelNeverUsesIsSaidOnce) {
  for (const bool tiles : {false, true}) {
    auto [net, ref] = twin_nets();
    auto config = base_config(16, 1);
    config["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 1e-2}}}};
    config["activation_checkpointing"] = {{"mlp_tiles", 2}};
    auto engine = strata::initialize(net, config);
    testing::internal::CaptureStdout();
    for (int64_t step = 0; step < 2; ++step) {
      auto d = batch(step, 16);
      auto loss = engine->forward(d.x, d.y);
      if (tiles)  // a tiled call, as a model's feed-forward would make
        loss = loss + strata::checkpointing::tiled_function(
                          [](const torch::Tensor& t) { return t * 0; }, {},
                          d.x.unsqueeze(0).requires_grad_(true))
                          .sum();
      engine->backward(loss);
      engine->step();
    }
    const std::string said = testing::internal::GetCapturedStdout();
    size_t warnings = 0;
    for (size_t at = 0; (at = said.find("mlp_tiles is 2 but the model ran no tiled", at)) != std::string::npos; ++at)
      ++warnings;
    EXPECT_EQ(warnings, tiles ? 0u : 1u) << said;
  }
}
