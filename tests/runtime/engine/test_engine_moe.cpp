// The engine with Strata's MoE layer, in one process: the experts' own optimizer (DeepSpeed's
// separate MoE parameter groups) and the set-ups it refuses. The multi-rank equivalences (ep_size
// 1, 2 and 4, expert data parallelism, checkpoints across ep_size) run the real trainer:
// tests/examples/test_train_gpt_moe.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "moe/layer.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/optim/adam.h"

namespace {

using strata::json;

// A token mixer with one MoE layer: embedding -> MoE -> head.
struct MoENetImpl : torch::nn::Module {
  MoENetImpl() {
    emb = register_module("emb", torch::nn::Embedding(16, 8));
    strata::moe::MoEOptions o(8, 16, 4);
    o.k = 2;
    o.capacity_factor = 2.0;
    o.seed = 3;
    moe = register_module("moe", strata::moe::MoE(o));
    head = register_module("head", torch::nn::Linear(8, 16));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto logits = head(moe(emb(x)));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 16}), y.reshape({-1})) +
           0.01 * moe->aux_loss();
  }
  torch::nn::Embedding emb{nullptr};
  strata::moe::MoE moe{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MoENet);

json config(int stage) {
  return {{"train_batch_size", 4},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
          {"scheduler",
           {{"type", "WarmupLR"},
            {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 1e-2}, {"warmup_num_steps", 4}}}}},
          {"zero_optimization", {{"stage", stage}}}};
}

// The experts take their own optimizer (here half the lr): the schedule moves both, keeping
// the ratio.
TEST(EngineMoE, ExpertsTakeTheirOwnOptimizerAndFollowTheSchedule) {
  for (int stage : {0, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    torch::manual_seed(0);
    MoENet net;
    strata::InitOptions init;
    init.expert_optimizer_builder = [](std::vector<torch::Tensor> params) {
      return std::make_unique<strata::optim::Adam>(
          std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(params)},
          strata::optim::AdamOptions(5e-3));
    };
    auto engine = strata::initialize(net, config(stage), init);
    ASSERT_NE(engine->expert_optimizer(), nullptr);
    const auto x = torch::randint(0, 16, {4, 6}), y = torch::randint(0, 16, {4, 6});
    for (int step = 0; step < 3; ++step) {
      engine->backward(engine->forward(x, y));
      engine->step();
      const double dense = engine->optimizer().param_groups()[0].options().get_lr();
      const double expert = engine->expert_optimizer()->param_groups()[0].options().get_lr();
      if (step > 0) {
        EXPECT_GT(dense, 0.0);  // WarmupLR (log) starts at warmup_min_lr
      }
      EXPECT_NEAR(expert, 0.5 * dense, 1e-12) << "step " << step;
    }
  }
}

// lr 0 for the experts: they do not move while the rest trains.
TEST(EngineMoE, ExpertOptimizerIsTheOneThatStepsTheExperts) {
  torch::manual_seed(0);
  MoENet net;
  const auto w1 = net->moe->experts->w1.detach().clone();
  const auto head = net->head->weight.detach().clone();
  strata::InitOptions init;
  init.expert_optimizer_builder = [](std::vector<torch::Tensor> params) {
    return std::make_unique<strata::optim::Adam>(
        std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(params)},
        strata::optim::AdamOptions(0.0).weight_decay(0.0));
  };
  json c = config(2);
  c.erase("scheduler");
  auto engine = strata::initialize(net, c, init);
  const auto x = torch::randint(0, 16, {4, 6}), y = torch::randint(0, 16, {4, 6});
  for (int step = 0; step < 3; ++step) {
    engine->backward(engine->forward(x, y));
    engine->step();
  }
  EXPECT_TRUE(torch::equal(net->moe->experts->w1.detach(), w1));
  EXPECT_FALSE(torch::equal(net->head->weight.detach(), head));
  EXPECT_GT(engine->last_grad_norm(), 0.0);
}

// Refused by name: MoE at ZeRO stage 3, frozen experts, a config whose moe block disagrees with
// the layers.
TEST(EngineMoE, UnsupportedSetUpsAreNamed) {
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const strata::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  {
    MoENet net;
    const auto m = message([&] { strata::initialize(net, config(3)); });
    EXPECT_NE(m.find("stage 3"), std::string::npos) << m;
    EXPECT_NE(m.find("moe.experts.w1"), std::string::npos) << m;
  }
  {
    MoENet net;
    net->moe->experts->b2.set_requires_grad(false);
    const auto m = message([&] { strata::initialize(net, config(2)); });
    EXPECT_NE(m.find("frozen"), std::string::npos) << m;
  }
  {
    MoENet net;
    json c = config(2);
    c["moe"] = {{"num_experts", 4}, {"ep_size", 2}};
    c["train_batch_size"] = 4;
    const auto m = message([&] { strata::initialize(net, c); });
    EXPECT_NE(m.find("ep_size"), std::string::npos) << m;
  }
}

}  // namespace
