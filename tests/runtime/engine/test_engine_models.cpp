// The models users hand the engine, beyond a stack of Linears: weights tied under two names,
// sparse embedding gradients, bool / int8 / int16 buffers and channels_last weights, many 16-bit
// micro-steps, ranks whose models differ, parameters on two devices. Each is checked against a
// reference computed another way (LibTorch's optimizer on the deduplicated parameters, a dense
// twin, exact arithmetic); the multi-rank cases re-run this binary as ranks through strata-run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "comm/process_group.h"
#include "comm/topology.h"
#include "moe/layer.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "tests/runtime/engine/launch_workers.h"

namespace {

using strata::json;
using strata::test_support::env_int;

constexpr const char* kWorker = "STRATA_MODELS_WORKER";
bool is_worker() { return strata::test_support::is_worker(kWorker); }

// ---- tied weights ------------------------------------------------------------------------------

// The usual C++ tie: the output head is the embedding, registered a second time by name.
struct TiedNetImpl : torch::nn::Module {
  explicit TiedNetImpl(int64_t vocab = 16) : vocab(vocab) {
    emb = register_module("emb", torch::nn::Embedding(vocab, 8));
    fc = register_module("fc", torch::nn::Linear(8, 8));
    register_parameter("out_w", emb->weight);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = torch::tanh(fc(emb(x)));
    auto logits = torch::matmul(h, emb->weight.t());
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), y.reshape({-1}));
  }
  // What Python's parameters() would list: each tensor once.
  std::vector<torch::Tensor> unique_parameters() { return {emb->weight, fc->weight, fc->bias}; }
  int64_t vocab;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TiedNet);

json tied_config(int64_t stage, bool sgd, int64_t global, int64_t gas) {
  json optimizer = sgd ? json{{"type", "SGD"}, {"params", {{"lr", 0.5}}}}
                       : json{{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}};
  return {{"train_batch_size", global},
          {"gradient_accumulation_steps", gas},
          {"steps_per_print", 1000},
          {"gradient_clipping", 0.5},
          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 50}}},
          {"optimizer", optimizer}};
}

// The engine on this rank's slices of each global batch against LibTorch's optimizer over the
// deduplicated parameters on the whole batch in this process.
void train_tied(int64_t stage, bool sgd, int rank, int world) {
  const int64_t global = 8, gas = 2, micro = global / (gas * world);
  torch::manual_seed(3);
  TiedNet net, ref;
  {
    torch::NoGradGuard no_grad;
    auto pn = net->unique_parameters(), pr = ref->unique_parameters();
    for (size_t i = 0; i < pn.size(); ++i) pr[i].copy_(pn[i]);
  }
  auto engine = strata::initialize(net, tied_config(stage, sgd, global, gas));
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (sgd)
    opt = std::make_unique<torch::optim::SGD>(ref->unique_parameters(),
                                              torch::optim::SGDOptions(0.5));
  else
    opt = std::make_unique<torch::optim::AdamW>(
        ref->unique_parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int64_t step = 0; step < 4; ++step) {
    torch::manual_seed(70 + step);
    const auto x = torch::randint(0, 16, {global, 6}), y = torch::randint(0, 16, {global, 6});
    for (int64_t m = 0; m < gas; ++m) {
      const int64_t first = (m * world + rank) * micro;
      engine->backward(engine->forward(x.narrow(0, first, micro), y.narrow(0, first, micro)));
      engine->step();
    }
    opt->zero_grad();
    ref->forward(x, y).backward();
    const double norm = torch::nn::utils::clip_grad_norm_(ref->unique_parameters(), 0.5);
    EXPECT_NEAR(engine->last_grad_norm(), norm, 1e-5 * norm) << "step " << step;
    opt->step();
    auto whole = engine->gathered_parameters();  // stage 3: every rank gathers the weights
    auto pn = net->unique_parameters(), pr = ref->unique_parameters();
    for (size_t i = 0; i < pn.size(); ++i)
      ASSERT_TRUE(torch::allclose(pn[i], pr[i], 1e-5, 1e-6))
          << "stage " << stage << (sgd ? " SGD" : " AdamW") << " rank " << rank << " step "
          << step << " parameter " << i << " differs by "
          << (pn[i] - pr[i]).abs().max().item<double>();
  }
  // The tie still holds: both names are one tensor.
  EXPECT_TRUE(net->named_parameters()["out_w"].is_same(net->emb->weight));
}

class TiedWeights : public testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(TiedWeights, TrainLikeLibTorchOnTheDeduplicatedParameters) {
  if (is_worker()) GTEST_SKIP();
  train_tied(std::get<0>(GetParam()), std::get<1>(GetParam()), 0, 1);
}

INSTANTIATE_TEST_SUITE_P(StagesAndOptimizers, TiedWeights,
                         testing::Combine(testing::Values(0, 1, 2, 3), testing::Bool()));

TEST(ModelsWorker, TiedWeightsTrainLikeLibTorchOnEveryStage) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineModels.*)";
  for (int stage : {0, 1, 2, 3})
    for (bool sgd : {true, false}) train_tied(stage, sgd, env_int("RANK"), env_int("WORLD_SIZE"));
}

// ---- ranks whose models differ -----------------------------------------------------------------

TEST(ModelsWorker, RanksWithDifferentModelsAreNamedNotTrained) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineModels.*)";
  const int rank = env_int("RANK");
  for (int stage : {0, 2}) {
    // Padding would make the flat sizes coincide at stage 2: the digest must still see it.
    TiedNet net(rank == 1 ? 1003 : 1000);
    try {
      strata::initialize(net, tied_config(stage, true, 8, 2));
      ADD_FAILURE() << "stage " << stage << ": rank " << rank << " trained a different model";
    } catch (const strata::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'out_w'"), std::string::npos) << what;  // the first registered
      EXPECT_NE(what.find("[1000, 8]"), std::string::npos) << what;
      EXPECT_NE(what.find("[1003, 8]"), std::string::npos) << what;
    }
  }
}

// MoE layers built over expert-parallel groups of the right size but other members than the
// engine's layout (runs of ep_size consecutive ranks): the engine would broadcast, reduce and
// checkpoint their experts as if rank r held the experts of its place in its layout group.
struct GroupedMoENetImpl : torch::nn::Module {
  explicit GroupedMoENetImpl(const strata::comm::GroupPtr& ep_group) {
    strata::moe::MoEOptions o(8, 16, 4);
    o.ep_size = 2;
    o.ep_group = ep_group;
    moe = register_module("moe", strata::moe::MoE(o));
  }
  torch::Tensor forward(const torch::Tensor& x) { return moe(x).pow(2).mean(); }
  strata::moe::MoE moe{nullptr};
};
TORCH_MODULE(GroupedMoENet);

TEST(MoEGroupsWorker, LayersOverOtherExpertGroupsAreRefusedByName) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineModels.MoE*)";
  const int rank = env_int("RANK");
  strata::InitOptions init;
  const json c = {{"train_batch_size", 8}, {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}},
                  {"zero_optimization", {{"stage", 2}}}};
  auto config = strata::load_engine_config(c, init);
  ASSERT_TRUE(init.group);
  // {0, 2} and {1, 3}: valid groups of 2 (they are the layout's expert-data-parallel groups).
  auto even = init.group->new_group({0, 2});
  auto odd = init.group->new_group({1, 3});
  GroupedMoENet net(rank % 2 == 0 ? even : odd);
  try {
    std::make_shared<strata::ModelEngine<GroupedMoENet>>(net, config, init);
    ADD_FAILURE() << "rank " << rank << " trained experts over another expert-parallel group";
  } catch (const strata::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ranks [" + std::string(rank % 2 == 0 ? "0, 2" : "1, 3") + "]"),
              std::string::npos) << what;
    EXPECT_NE(what.find("ranks [" + std::string(rank < 2 ? "0, 1" : "2, 3") + "]"),
              std::string::npos) << what;
    EXPECT_NE(what.find("expert_groups"), std::string::npos) << what;
  }
  // The layout's own groups train.
  GroupedMoENet ok(strata::comm::expert_groups(init.group, 2).expert_parallel);
  auto engine = std::make_shared<strata::ModelEngine<GroupedMoENet>>(ok, config, init);
  engine->backward(engine->forward(torch::randn({2, 4, 8})));
  engine->step();
}

// ---- buffers of any dtype, channels_last weights ---------------------------------------------

struct OddNetImpl : torch::nn::Module {
  explicit OddNetImpl(int rank) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
    {
      torch::NoGradGuard no_grad;
      conv->weight.set_data(conv->weight.contiguous(at::MemoryFormat::ChannelsLast));
      conv->weight.add_(0.1 * rank);
    }
    // Rank 1 starts from other values; every rank must end with rank 0's.
    mask = register_buffer("mask", rank == 0 ? torch::ones({4, 4}, torch::kBool).tril()
                                             : torch::zeros({4, 4}, torch::kBool));
    codes = register_buffer("codes", torch::full({5}, rank == 0 ? -3 : 9, torch::kChar));
    ids = register_buffer("ids", torch::arange(6, torch::kShort) * (rank + 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = conv(x).mean({2, 3});  // [B, 4]
    return (h.matmul(mask.to(torch::kFloat)) * codes.sum().to(torch::kFloat)).pow(2).mean();
  }
  torch::nn::Conv2d conv{nullptr};
  torch::Tensor mask, codes, ids;
};
TORCH_MODULE(OddNet);

TEST(ModelsWorker, BoolIntBuffersAndChannelsLastWeightsStartFromRankZero) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineModels.*)";
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  for (int stage : {0, 2}) {
    OddNet net(rank), rank0(0);
    json config = {{"train_batch_size", 2 * world},
                   {"steps_per_print", 1000},
                   {"zero_optimization", {{"stage", stage}}},
                   {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}}};
    auto engine = strata::initialize(net, config);
    EXPECT_TRUE(torch::equal(net->mask, rank0->mask)) << "stage " << stage;
    EXPECT_TRUE(torch::equal(net->codes, rank0->codes)) << "stage " << stage;
    EXPECT_TRUE(torch::equal(net->ids, rank0->ids)) << "stage " << stage;
    torch::manual_seed(5);
    engine->backward(engine->forward(torch::randn({2, 3, 6, 6})));
    engine->step();
    EXPECT_EQ(engine->global_steps(), 1);
  }
}

// ---- sparse embedding gradients ------------------------------------------------------------------

struct EmbedNetImpl : torch::nn::Module {
  explicit EmbedNetImpl(bool sparse) {
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(20, 6).sparse(sparse)));
    fc = register_module("fc", torch::nn::Linear(6, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return (fc(emb(x)).squeeze(-1).mean(1) - y).pow(2).mean();
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(EmbedNet);

// A sparse-gradient embedding trains exactly like its dense twin.
void train_sparse_vs_dense(int64_t stage, int rank, int world) {
  const int64_t global = 8, micro = global / (2 * world);
  torch::manual_seed(9);
  EmbedNet sparse(true), dense(false);
  {
    torch::NoGradGuard no_grad;
    auto ps = sparse->parameters(), pd = dense->parameters();
    for (size_t i = 0; i < ps.size(); ++i) pd[i].copy_(ps[i]);
  }
  json config = {{"train_batch_size", global},
                 {"gradient_accumulation_steps", 2},
                 {"steps_per_print", 1000},
                 {"sparse_gradients", true},
                 {"gradient_clipping", 1.0},
                 {"zero_optimization", {{"stage", stage}}},
                 {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
  auto es = strata::initialize(sparse, config), ed = strata::initialize(dense, config);
  for (int64_t step = 0; step < 3; ++step) {
    torch::manual_seed(40 + step);
    const auto x = torch::randint(0, 20, {global, 5});
    const auto y = torch::randn({global});
    for (int64_t m = 0; m < 2; ++m) {
      const int64_t first = (m * world + rank) * micro;
      const auto xs = x.narrow(0, first, micro), ys = y.narrow(0, first, micro);
      es->backward(es->forward(xs, ys));
      es->step();
      ed->backward(ed->forward(xs, ys));
      ed->step();
    }
  }
  auto ps = sparse->parameters(), pd = dense->parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_TRUE(torch::allclose(ps[i], pd[i], 1e-6, 1e-7))
        << "stage " << stage << " parameter " << i << " differs by "
        << (ps[i] - pd[i]).abs().max().item<double>();
}

TEST(SparseGradients, TrainLikeTheDenseTwinInOneProcess) {
  if (is_worker()) GTEST_SKIP();
  for (int64_t stage : {0, 1, 2}) train_sparse_vs_dense(stage, 0, 1);
}

TEST(ModelsWorker, SparseGradientsTrainLikeTheDenseTwin) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineModels.*)";
  for (int64_t stage : {0, 1, 2}) train_sparse_vs_dense(stage, env_int("RANK"), env_int("WORLD_SIZE"));
}

// ---- gradients summed over many 16-bit micro-steps ---------------------------------------------

struct OneWeightImpl : torch::nn::Module {
  OneWeightImpl() { w = register_parameter("w", torch::ones({1})); }
  torch::Tensor forward(double c) { return (w.to(torch::kFloat) * c).sum(); }
  torch::Tensor w;
};
TORCH_MODULE(OneWeight);

// 16 bf16 micro-steps, each with gradient 70/16 = 4.375 (exact in bf16): the window's mean is
// exactly 70. Summed in bf16 the running sum rounds from 39.375 on (9 significant bits).
double accumulated_gradient(int64_t stage, int world, const json& data_types) {
  OneWeight net;
  json config = {{"train_batch_size", 16 * world},
                 {"gradient_accumulation_steps", 16},
                 {"steps_per_print", 1000},
                 {"bf16", {{"enabled", true}}},
                 {"zero_optimization", {{"stage", stage}}},
                 {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.0}}}}}};
  if (!data_types.is_null()) config["data_types"] = data_types;
  auto engine = strata::initialize(net, config);
  for (int m = 0; m < 16; ++m) {
    engine->backward(engine->forward(70.0));
    engine->step();
  }
  EXPECT_EQ(engine->global_steps(), 1);
  return engine->last_grad_norm();
}

TEST(GradientAccumulation, Bf16SumsInFp32ByDefault) {
  if (is_worker()) GTEST_SKIP();
  for (int64_t stage : {0, 1, 2}) {
    EXPECT_EQ(accumulated_gradient(stage, 1, nullptr), 70.0) << "stage " << stage;
    EXPECT_EQ(accumulated_gradient(stage, 1, {{"grad_accum_dtype", "fp32"}}), 70.0);
    // Asked for: the model's own dtype, and its rounding.
    EXPECT_NE(accumulated_gradient(stage, 1, {{"grad_accum_dtype", "bf16"}}), 70.0);
  }
}

TEST(GradientAccumulation, AnotherSixteenBitDtypeIsRefused) {
  if (is_worker()) GTEST_SKIP();
  try {
    accumulated_gradient(0, 1, {{"grad_accum_dtype", "fp16"}});
    FAIL() << "fp16 accumulation of a bf16 model was accepted";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("grad_accum_dtype"), std::string::npos) << e.what();
  }
}

TEST(ModelsWorker, Bf16SumsInFp32AcrossRanks) {
  if (!is_worker()) GTEST_SKIP() << "runs under strata-run (see EngineModels.*)";
  for (int64_t stage : {0, 1, 2})
    EXPECT_EQ(accumulated_gradient(stage, env_int("WORLD_SIZE"), nullptr), 70.0)
        << "stage " << stage;
}

// ---- parameters on two devices ------------------------------------------------------------------

struct TwoDeviceNetImpl : torch::nn::Module {
  TwoDeviceNetImpl() {
    a = register_parameter("a", torch::ones({3}));
    b = register_parameter("b", torch::empty({3}, torch::TensorOptions().device(torch::kMeta)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return (a * x).sum(); }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoDeviceNet);

TEST(TwoDevices, AreRefusedNamingBoth) {
  if (is_worker()) GTEST_SKIP();
  for (int stage : {0, 2}) {
    TwoDeviceNet net;
    json config = {{"train_micro_batch_size_per_gpu", 1},
                   {"zero_optimization", {{"stage", stage}}},
                   {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}}};
    try {
      strata::initialize(net, config);
      FAIL() << "stage " << stage << ": a model on two devices was accepted";
    } catch (const strata::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'a' on cpu"), std::string::npos) << what;
      EXPECT_NE(what.find("'b' on meta"), std::string::npos) << what;
    }
  }
}

// ---- the ranks -----------------------------------------------------------------------------------

class EngineModels : public testing::TestWithParam<int> {};

TEST_P(EngineModels, EveryWorkerCasePassesOnEveryRank) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers(kWorker, GetParam(), "ModelsWorker.*", &output), 0)
      << output;
  EXPECT_NE(output.find("[  PASSED  ] 5 tests"), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(Ranks, EngineModels, testing::Values(2));

// Four ranks: expert-parallel groups of 2 that can differ from the layout's.
TEST(EngineModelsMoE, LayersOverOtherExpertGroupsAreRefusedOnFourRanks) {
  if (is_worker()) GTEST_SKIP();
  std::string output;
  EXPECT_EQ(strata::test_support::launch_workers(kWorker, 4, "MoEGroupsWorker.*", &output), 0)
      << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
}

}  // namespace
