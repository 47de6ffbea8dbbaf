// The engine with Strata's MoE layer, in one process: the experts' own optimizer (DeepSpeed's
// separate MoE parameter groups), the experts' own units at ZeRO stage 3, and the set-ups it
// refuses. The multi-rank equivalences (ep_size
// 1, 2 and 4, expert data parallelism, checkpoints across ep_size) run the real trainer:
// tests/examples/test_train_gpt_moe.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "moe/layer.h"
#include "runtime/util/file_tree.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/engine.h"
#include "zero/partitioned_init.h"
#include "runtime/error.h"
#include "runtime/model_check.h"
#include "runtime/optim/adam.h"

namespace {

using strata::json;

// A token mixer with one MoE layer: embedding -> MoE -> head.
// `noise`: top-2's 2nd-expert sampling (DeepSpeed's default) on.
struct MoENetImpl : torch::nn::Module {
  explicit MoENetImpl(bool noise = true) {
    emb = register_module("emb", torch::nn::Embedding(16, 8));
    strata::moe::MoEOptions o(8, 16, 4);
    o.k = 2;
    o.capacity_factor = 2.0;
    o.top2_2nd_expert_sampling = noise;
    o.seed = 3;
    moe = register_module("moe", strata::moe::MoE(o));
    head = register_module("head", torch::nn::Linear(8, 16));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto logits = head(moe(emb(x)));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 16}), y.reshape({-1})) +
           moe->loss();
  }
  torch::nn::Embedding emb{nullptr};
  strata::moe::MoE moe{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MoENet);

// A router of one's own with its experts in a ModuleList named "experts" (Mixtral's naming).
struct OwnMoEImpl : torch::nn::Module {
  OwnMoEImpl() {
    router = register_module("router", torch::nn::Linear(8, 2));
    experts = register_module(
        "experts", torch::nn::ModuleList(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x; }
  torch::nn::Linear router{nullptr};
  torch::nn::ModuleList experts{nullptr};
};
TORCH_MODULE(OwnMoE);

json config(int stage) {
  return {{"train_batch_size", 4},
          {"gradient_clipping", 0.5},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
          {"scheduler",
           {{"type", "WarmupLR"},
            {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 1e-2}, {"warmup_num_steps", 4}}}}},
          {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
}

// The experts take their own optimizer (here half the lr): the schedule moves both, keeping
// the ratio.
TEST(EngineMoE, ExpertsTakeTheirOwnOptimizerAndFollowTheSchedule) {
  for (int stage : {0, 2, 3}) {
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

// Losses of `steps` optimizer steps on fixed batches; with `resume_at`, a fresh engine (fresh
// model) loads the checkpoint saved after that many steps and trains the rest.
std::vector<double> train(int stage, bool noise, int steps, int resume_at, const std::string& dir) {
  std::vector<double> losses;
  auto batch = [](int step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randint(0, 16, {4, 6});
    return std::make_pair(x, (x * 3 + 1) % 16);
  };
  auto run = [&](int from, int to, bool save, bool load) {
    torch::manual_seed(0);
    MoENet net(noise);
    auto engine = strata::initialize(net, config(stage));
    if (load) engine->load_checkpoint(dir);
    for (int step = from; step < to; ++step) {
      const auto [x, y] = batch(step);
      const auto loss = engine->forward(x, y);
      losses.push_back(loss.item<double>());
      engine->backward(loss);
      engine->step();
    }
    if (save) engine->save_checkpoint(dir);
  };
  if (resume_at < 0) {
    run(0, steps, false, false);
  } else {
    run(0, resume_at, true, false);
    run(resume_at, steps, false, true);
  }
  return losses;
}

// Resuming gives the losses of the run that went straight on. WarmupLR from 0: the experts' lr
// at construction is 0, so an expert optimizer left at it after load_checkpoint (not moved to
// the schedule's lr, as the dense one is) would not train the experts on the first resumed step.
// Without gate noise here, so that only the learning rates matter.
TEST(EngineMoE, ResumeStepsTheExpertsAtTheSchedulesLr) {
  for (int stage : {0, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string dir = testing::TempDir() + "/moe_resume_lr_" + std::to_string(getpid()) +
                            "_" + std::to_string(stage);
    const auto straight = train(stage, /*noise=*/false, 6, -1, dir);
    const auto resumed = train(stage, /*noise=*/false, 6, 3, dir);
    strata::util::remove_tree(dir);  // not std::filesystem: see README, pip LibTorch
    ASSERT_EQ(resumed.size(), straight.size());
    for (size_t i = 0; i < straight.size(); ++i)
      EXPECT_NEAR(resumed[i], straight[i], 1e-6 * std::abs(straight[i])) << "step " << i + 1;
  }
}

// With the gate's noise on (top-2's 2nd-expert sampling, DeepSpeed's default), the program
// calling nothing but forward: the resumed run draws the noise the straight one drew at those
// calls, not that of calls 0, 1, ... again (the layers' call counters are in the checkpoint).
TEST(EngineMoE, ResumeContinuesTheGateNoise) {
  for (int stage : {0, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string dir = testing::TempDir() + "/moe_resume_noise_" + std::to_string(getpid()) +
                            "_" + std::to_string(stage);
    const auto straight = train(stage, /*noise=*/true, 6, -1, dir);
    const auto resumed = train(stage, /*noise=*/true, 6, 3, dir);
    strata::util::remove_tree(dir);  // not std::filesystem: see README, pip LibTorch
    ASSERT_EQ(resumed.size(), straight.size());
    for (size_t i = 0; i < straight.size(); ++i)
      EXPECT_NEAR(resumed[i], straight[i], 1e-6 * std::abs(straight[i])) << "step " << i + 1;
  }
}

// lr 0 for the experts: they do not move while the rest trains (at stage 3 too, where both are
// read inside a gathered scope).
TEST(EngineMoE, ExpertOptimizerIsTheOneThatStepsTheExperts) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
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
    json c = config(stage);
    c.erase("scheduler");
    auto engine = strata::initialize(net, c, init);
    const auto x = torch::randint(0, 16, {4, 6}), y = torch::randint(0, 16, {4, 6});
    for (int step = 0; step < 3; ++step) {
      engine->backward(engine->forward(x, y));
      engine->step();
    }
    const auto gathered = engine->gathered_parameters();
    EXPECT_TRUE(torch::equal(net->moe->experts->w1.detach(), w1));
    EXPECT_FALSE(torch::equal(net->head->weight.detach(), head));
    EXPECT_GT(engine->last_grad_norm(), 0.0);
  }
}

// ZeRO stage 3: the experts form a unit of their own (the layer's local experts), outside the
// others' units, released between uses like them; training gives the losses and gradient norms
// of stage 2 (one process: only the layout differs).
TEST(EngineMoE, StageThreeKeepsTheExpertsInTheirOwnUnit) {
  std::vector<double> losses[2], norms[2];
  const auto x = torch::randint(0, 16, {4, 6}), y = torch::randint(0, 16, {4, 6});
  for (int run = 0; run < 2; ++run) {
    torch::manual_seed(0);
    MoENet net;
    auto engine = strata::initialize(net, config(run == 0 ? 2 : 3));
    for (int step = 0; step < 4; ++step) {
      const auto loss = engine->forward(x, y);
      losses[run].push_back(loss.item<double>());
      engine->backward(loss);
      engine->step();
      norms[run].push_back(engine->last_grad_norm());
    }
    if (run == 0) continue;
    const auto* experts = engine->stage3_expert_units();
    ASSERT_NE(experts, nullptr);
    ASSERT_EQ(experts->size(), 1u);
    EXPECT_EQ(experts->unit(0).name, "moe.experts");
    EXPECT_EQ(experts->unit(0).params.size(), 4u);  // w1, b1, w2, b2
    EXPECT_FALSE(experts->unit(0).gathered);         // released after its last use
    // Gathered for every step's forward and kept into backward (the layer is the last expert
    // unit forward touches and the first backward does).
    EXPECT_GE(experts->unit(0).gathers, 4);
    const auto* dense = engine->stage3_units();
    for (size_t u = 0; u < dense->size(); ++u)
      for (const auto& name : dense->unit(u).names)
        EXPECT_EQ(name.find("experts"), std::string::npos) << name;
  }
  for (size_t i = 0; i < losses[0].size(); ++i) {
    EXPECT_NEAR(losses[1][i], losses[0][i], 1e-6 * std::abs(losses[0][i])) << "step " << i + 1;
    EXPECT_NEAR(norms[1][i], norms[0][i], 1e-5 * norms[0][i]) << "step " << i + 1;
  }
}

// Stage 3 with the parameters on NVMe and the optimizer in host memory: the experts' 16-bit
// weights are saved from the host master (there are no swapped tiles to stream them from), and
// the checkpoint resumes to the same loss. Found by the matrix's soak (the save threw "the state
// is not on NVMe").
TEST(EngineMoE, StageThreeSavesExpertsWithParametersOnNvmeAndTheOptimizerInHostMemory) {
  const std::string dir = testing::TempDir() + "/moe_nvme_params_" + std::to_string(getpid());
  std::filesystem::create_directories(dir + "/swap");
  json c = config(3);
  c["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", dir + "/swap"}};
  c["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  const auto x = torch::randint(0, 16, {4, 6}), y = (x * 3 + 1) % 16;
  double saved_loss = 0.0;
  {
    torch::manual_seed(0);
    MoENet net(/*noise=*/false);
    auto engine = strata::initialize(net, c);
    for (int step = 0; step < 2; ++step) {
      engine->backward(engine->forward(x, y));
      engine->step();
    }
    ASSERT_NO_THROW(engine->save_checkpoint(dir + "/ckpt"));
    torch::NoGradGuard no_grad;
    saved_loss = engine->forward(x, y).item<double>();
  }
  torch::manual_seed(1);
  MoENet net(/*noise=*/false);
  auto engine = strata::initialize(net, c);
  engine->load_checkpoint(dir + "/ckpt");
  torch::NoGradGuard no_grad;
  EXPECT_NEAR(engine->forward(x, y).item<double>(), saved_loss, 1e-6 * std::abs(saved_loss));
  strata::util::remove_tree(dir);  // not std::filesystem: see README, pip LibTorch
}

// Refused by name: an MoE model built in shards (PartitionedInit shards over the world, experts
// belong to their expert-data-parallel group), frozen experts, a config whose moe block disagrees
// with the layers, experts of one's own router outside a strata::moe::MoE.
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
    strata::InitOptions options;
    options.partitioned_init = strata::zero::PartitionedInit::create(nullptr);
    MoENet net;
    const auto m = message([&] { strata::initialize(net, config(3), options); });
    EXPECT_NE(m.find("PartitionedInit"), std::string::npos) << m;
    EXPECT_NE(m.find("moe.experts.w1"), std::string::npos) << m;
  }
  for (int stage : {2, 3}) {  // nothing trainable but experts
    MoENet net;
    for (auto& p : net->named_parameters())
      if (p.key().find("experts") == std::string::npos) p.value().set_requires_grad(false);
    const auto m = message([&] { strata::initialize(net, config(stage)); });
    EXPECT_NE(m.find("every trainable parameter is an MoE expert"), std::string::npos)
        << "stage " << stage << ": " << m;
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
  {  // ep_size 2 in one process: named at the key's file:line, as at world size 3 (at world size
     // 1, the stand-in of tools that do not know the world, the config check used to skip it)
    const std::string path =
        testing::TempDir() + "/moe_ep2_world1_" + std::to_string(getpid()) + ".json";
    std::ofstream(path) << "{\n  \"train_batch_size\": 4,\n  \"moe\": {\n    \"num_experts\": 4,\n"
                           "    \"ep_size\": 2\n  }\n}\n";
    MoENet net;
    const auto m = message([&] { strata::initialize(net, path); });
    std::filesystem::remove(path);
    EXPECT_NE(m.find(path + ":5:"), std::string::npos) << m;
    EXPECT_NE(m.find("moe.ep_size = 2 does not divide the world size 1"), std::string::npos) << m;
  }
  {  // any key of the block the layers were built without would do nothing
    MoENet net;  // k = 2
    json c = config(2);
    c["moe"] = {{"top_k", 1}};
    const auto m = message([&] { strata::initialize(net, c); });
    EXPECT_NE(m.find("moe.top_k is 1 in the config, the layer's is 2 (MoE layer 0)"),
              std::string::npos) << m;
  }
  {  // aux_loss_coef weighs the layer's loss(): a layer built with another would ignore it
    MoENet net;  // 0.01, MoEOptions' default
    json c = config(2);
    c["moe"] = {{"aux_loss_coef", 0.5}};
    const auto m = message([&] { strata::initialize(net, c); });
    EXPECT_NE(m.find("moe.aux_loss_coef is 0.5 in the config, the layer's is 0.01"),
              std::string::npos) << m;
  }
  {  // a router of one's own: its experts would be ordinary parameters, mixed over the ranks
    OwnMoE own;
    const auto m = message([&] { strata::initialize(own, config(2)); });
    EXPECT_NE(m.find("parameter 'experts.0.weight' sits in a module named 'experts' outside any "
                     "strata::moe::MoE layer"),
              std::string::npos) << m;
    EXPECT_NE(m.find("expert_factory"), std::string::npos) << m;
  }
  {  // the keys it follows: no error
    MoENet net;
    json c = config(2);
    c["moe"] = {{"top_k", 2}, {"capacity_factor", 2.0}, {"aux_loss_coef", 0.01}};
    EXPECT_EQ(message([&] { strata::initialize(net, c); }), "no error");
  }
}

}  // namespace

namespace {

// DeepSeek-V3's router in two layers: sigmoid scores chosen with a balancing bias that moves
// after every optimizer step.
struct BiasedMoENetImpl : torch::nn::Module {
  BiasedMoENetImpl() {
    emb = register_module("emb", torch::nn::Embedding(16, 8));
    for (int l = 0; l < 2; ++l) {
      strata::moe::MoEOptions o(8, 16, 4);
      o.k = 2;
      o.drop_tokens = false;
      o.score_func = strata::moe::ScoreFunc::Sigmoid;
      o.bias_update_speed = 0.05;
      o.aux_loss_coef = 0.0;
      o.seed = 3;
      o.layer_id = l;
      moe.push_back(register_module("moe" + std::to_string(l), strata::moe::MoE(o)));
    }
    head = register_module("head", torch::nn::Linear(8, 16));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = emb(x);
    for (auto& m : moe) h = h + m(h);
    return torch::nn::functional::cross_entropy(head(h).reshape({-1, 16}).to(torch::kFloat),
                                                y.reshape({-1}));
  }
  // Each layer's experts chosen per route (k per token) for `x`, in eval mode.
  std::vector<torch::Tensor> routes(const torch::Tensor& x) {
    torch::NoGradGuard no_grad;
    eval();
    std::vector<torch::Tensor> out;
    auto h = emb(x);
    for (auto& m : moe) {
      const auto logits = torch::mm(h.reshape({-1, 8}).to(torch::kFloat),
                                    m->gate->weight.to(torch::kFloat).t());
      auto go = m->options().gate_options();
      go.training = false;
      go.expert_bias = m->expert_bias().to(torch::kFloat);
      out.push_back(strata::moe::gate_routes(logits, go).expert);
      h = h + m(h);
    }
    train();
    return out;
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<strata::moe::MoE> moe;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BiasedMoENet);

}  // namespace

// The balancing bias is a float32 buffer of each layer's gate ("moe0.gate.e_score_correction_
// bias", Hugging Face DeepSeek-V3's name): bf16 training leaves it float32, and save_16bit_model,
// `strata-ckpt consolidate` (bf16 archive and safetensors) carry it, float32; models loaded from
// them choose the trained model's experts. (It was kept apart from the module's tensors, so every
// export routed with a zero bias.)
TEST(EngineMoE, TheBalancingBiasTravelsInEveryExport) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string dir = testing::TempDir() + "/moe_bias_export_" + std::to_string(getpid()) +
                            "_" + std::to_string(stage);
    torch::manual_seed(0);
    BiasedMoENet net;
    auto c = config(stage);
    c["bf16"] = {{"enabled", true}};
    c["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
    auto engine = strata::initialize(net, c);
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(50 + step);
      const auto x = torch::randint(0, 16, {4, 6});
      engine->backward(engine->forward(x, (x * 5 + 2) % 16));
      engine->step();
    }
    const std::string name[2] = {"moe0.gate.e_score_correction_bias", "moe1.gate.e_score_correction_bias"};
    std::vector<torch::Tensor> trained;
    for (int l = 0; l < 2; ++l) {
      const auto& b = net->moe[size_t(l)]->expert_bias();
      ASSERT_EQ(b.scalar_type(), torch::kFloat) << "the bias must not be cast to bf16";
      ASSERT_GT(b.abs().max().item<double>(), 0.0) << "the bias should have moved";
      EXPECT_TRUE(net->named_buffers().contains(name[l]));
      trained.push_back(b.clone());
    }
    torch::manual_seed(77);
    const auto probe = torch::randint(0, 16, {3, 6});
    std::vector<torch::Tensor> routes;
    {
      auto gathered = engine->gathered_parameters();
      routes = net->routes(probe);
    }
    auto expect_routes_as_trained = [&](BiasedMoENet& loaded, const std::string& what) {
      for (int l = 0; l < 2; ++l) {
        const auto& b = loaded->moe[size_t(l)]->expert_bias();
        EXPECT_EQ(b.scalar_type(), torch::kFloat) << what;
        EXPECT_TRUE(torch::equal(b, trained[size_t(l)])) << what << ": layer " << l;
      }
      const auto got = loaded->routes(probe);
      for (int l = 0; l < 2; ++l)
        EXPECT_TRUE(torch::equal(got[size_t(l)], routes[size_t(l)])) << what << ": layer " << l;
    };

    // A 16-bit archive loads into a model cast as the engine casts it (torch::load keeps each
    // tensor's dtype): the bias stays float32 there too.
    engine->save_16bit_model(dir, "model16.pt");
    BiasedMoENet from_16bit;
    strata::cast_floating_point(*from_16bit, torch::kBFloat16);
    torch::load(from_16bit, dir + "/model16.pt");
    expect_routes_as_trained(from_16bit, "save_16bit_model");

    engine->save_checkpoint(dir);
    const std::string ckpt = std::string(STRATA_BIN_DIR) + "/strata-ckpt consolidate " + dir +
                             " --dtype bf16 --out " + dir + "/c.pt --safetensors " + dir +
                             "/c.safetensors 2>&1";
    ASSERT_EQ(std::system(ckpt.c_str()), 0) << ckpt;
    BiasedMoENet from_consolidated;
    strata::cast_floating_point(*from_consolidated, torch::kBFloat16);
    torch::load(from_consolidated, dir + "/c.pt");
    expect_routes_as_trained(from_consolidated, "strata-ckpt consolidate --out");
    const auto st = strata::checkpoint::load_safetensors(dir + "/c.safetensors");
    for (int l = 0; l < 2; ++l) {
      const auto& b = st.at(name[l]);
      EXPECT_EQ(b.scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::equal(b, trained[size_t(l)])) << "safetensors: layer " << l;
    }
    // A resume restores it from the buffer.
    torch::manual_seed(0);
    BiasedMoENet resumed;
    auto again = strata::initialize(resumed, c);
    again->load_checkpoint(dir);
    for (int l = 0; l < 2; ++l)
      EXPECT_TRUE(torch::equal(resumed->moe[size_t(l)]->expert_bias(), trained[size_t(l)]));
    strata::util::remove_tree(dir);  // not std::filesystem: see README, pip LibTorch
  }
}
