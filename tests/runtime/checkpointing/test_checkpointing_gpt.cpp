// The example GPT's checkpoint policies against the same model without checkpointing: the loss
// and every parameter's gradient, in one process, without the engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include <torch/torch.h>

#include "examples/gpt.h"

namespace {

using strata::examples::GPT;
using strata::examples::GPTConfig;

struct Grads {
  double loss = 0;
  std::vector<std::pair<std::string, torch::Tensor>> grads;
};

Grads run(const std::string& model, const std::string& policy, uint64_t seed = 7,
          int64_t mlp_tiles = -1) {
  auto config = GPTConfig::by_name(model);
  config.checkpointing = policy;
  config.mlp_tiles = mlp_tiles;
  torch::manual_seed(seed);
  GPT gpt(config);
  gpt->train();
  torch::manual_seed(seed + 1);
  const auto tokens = torch::randint(config.vocab, {4, config.seq_len}, torch::kLong);
  const auto targets = torch::randint(config.vocab, {4, config.seq_len}, torch::kLong);
  torch::manual_seed(seed + 2);  // dropout's draws start here in both runs
  auto loss = gpt->forward(tokens, targets);
  loss.backward();
  Grads g;
  g.loss = loss.item<double>();
  for (const auto& p : gpt->named_parameters())
    g.grads.emplace_back(p.key(), p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor());
  return g;
}

void expect_same(const Grads& a, const Grads& b, const std::string& what) {
  EXPECT_NEAR(a.loss, b.loss, 1e-6) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  double largest = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    const auto& [name, ga] = a.grads[i];
    const auto& gb = b.grads[i].second;
    ASSERT_EQ(ga.defined(), gb.defined()) << what << ": " << name;
    if (!ga.defined()) continue;
    const double diff = (ga - gb).abs().max().item<double>();
    largest = std::max(largest, diff);
    EXPECT_LE(diff, 1e-6) << what << ": " << name << " differs by " << diff;
  }
  std::printf("[ %s ] loss %.9g vs %.9g; largest gradient difference %g over %zu tensors\n",
              what.c_str(), a.loss, b.loss, largest, a.grads.size());
}

TEST(CheckpointGPT, EveryBlockAndSelectiveGiveTheGradientsOfThePlainModelWithDropout) {
  const auto plain = run("tiny-dropout", "none");
  for (const std::string policy : {"every", "every:2", "selective"})
    expect_same(plain, run("tiny-dropout", policy), policy);
}

// Without dropout the example checkpoints a block as its two residual branches, neither
// recomputing its last product (checkpoint_into_linear twice): the other path of
// BlockImpl::forward_checkpointed.
TEST(CheckpointGPT, BlocksCheckpointedAsTwoBranchesGiveTheGradientsOfThePlainModel) {
  const auto plain = run("tiny", "none");
  for (const std::string policy : {"every", "every:2", "selective"})
    expect_same(plain, run("tiny", policy), "no dropout, " + policy);
}

// The tiled feed-forward (GPTConfig::mlp_tiles: each block's norm and MLP over tiles of the
// sequence) under every policy, with dropout around it: the plain model's loss and gradients.
TEST(CheckpointGPT, TiledFeedForwardGivesThePlainGradientsUnderEveryPolicy) {
  for (const std::string model : {"tiny", "tiny-dropout"}) {
    const auto plain = run(model, "none");
    for (const std::string policy : {"none", "every", "every:2", "selective"})
      for (int64_t tiles : {0, 3, 64})
        expect_same(plain, run(model, policy, 7, tiles),
                    model + ", " + policy + ", " + std::to_string(tiles) + " tiles");
  }
}

// The masked model (GPTConfig::masked: an explicit additive mask, the second input of every
// whole block's checkpoint) computes what the causal model does, under every policy; with
// dropout its checkpoints give the gradients of its own run without checkpointing.
TEST(CheckpointGPT, TheMaskedModelGivesTheCausalModelsGradientsUnderEveryPolicy) {
  const auto plain = run("tiny", "none");
  for (const std::string policy : {"none", "every", "every:2", "selective"})
    expect_same(plain, run("tiny-masked", policy), "masked, " + policy);
  const auto dropout = run("tiny-masked-dropout", "none");
  for (const std::string policy : {"every", "every:2", "selective"})
    expect_same(dropout, run("tiny-dropout-masked", policy), "masked with dropout, " + policy);
}

// Memory, measured at malloc (tests/alloc_meter), never by the feature's own tally. A GPT of 8
// blocks whose activations dominate (d 64, 128 tokens x 8 samples, vocabulary 64). With every
// block checkpointed, the peak of forward + backward over what the model holds anyway must stay
// within
//     outside + inputs + one_block
// where
//   outside   = the peak of the same model with no blocks (embedding, final norm, head, loss,
//               and the gradients of those parameters), measured;
//   inputs    = the checkpointed inputs: 8 blocks x 2 residual branches (the example checkpoints
//               each branch of a plain block) x 8 x 128 x 64 fp32 = 4 MiB, by the formula;
//   one_block = the peak of one block's forward + backward alone (its activations, the
//               transients of its backward, its parameters' gradients), measured;
// plus the gradients of the other blocks' parameters (they stay: 7 x one block's parameters).
}  // namespace

#include "../../alloc_meter.h"

namespace {

GPTConfig memory_config(int64_t layers) {
  GPTConfig c;
  c.name = "memory";
  c.vocab = 64, c.d_model = 64, c.layers = layers, c.heads = 4, c.ffn = 256, c.seq_len = 128;
  return c;
}

constexpr int64_t kBatch = 8;

int64_t peak_of_step(GPT& gpt, const torch::Tensor& tokens, const torch::Tensor& targets) {
  for (auto& p : gpt->parameters()) p.mutable_grad() = torch::Tensor();
  strata::test::AllocMeter::reset_peak();
  gpt->forward(tokens, targets).backward();
  return strata::test::AllocMeter::peak_since_reset();
}

TEST(CheckpointMemory, EveryBlockStaysWithinOneBlockPlusTheCheckpointedInputs) {
  ASSERT_TRUE(strata::test::AllocMeter::active());
  torch::manual_seed(3);
  const auto tokens = torch::randint(64, {kBatch, 128}, torch::kLong);
  const auto targets = torch::randint(64, {kBatch, 128}, torch::kLong);
  const int64_t layers = 8;

  auto measure = [&](const std::string& policy) {
    auto c = memory_config(layers);
    c.checkpointing = policy;
    torch::manual_seed(1);
    GPT gpt(c);
    peak_of_step(gpt, tokens, targets);  // the first step's one-time allocations
    return peak_of_step(gpt, tokens, targets);
  };
  auto c0 = memory_config(0);
  torch::manual_seed(1);
  GPT bare(c0);
  peak_of_step(bare, tokens, targets);
  const int64_t outside = peak_of_step(bare, tokens, targets);

  auto c1 = memory_config(1);
  torch::manual_seed(1);
  GPT one(c1);
  auto& block = *one->named_modules()["blocks.0"];
  auto x = torch::randn({kBatch, 128, 64}, torch::requires_grad());
  auto g = torch::randn({kBatch, 128, 64});
  int64_t one_block = 0, block_param_bytes = 0;
  for (auto& p : block.parameters()) block_param_bytes += p.numel() * 4;
  for (int i = 0; i < 2; ++i) {
    for (auto& p : block.parameters()) p.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    strata::test::AllocMeter::reset_peak();
    block.as<strata::examples::Block>()->forward(x).backward(g);
    one_block = strata::test::AllocMeter::peak_since_reset();
  }
  const int64_t inputs = layers * 2 * kBatch * 128 * 64 * 4;
  const int64_t other_grads = (layers - 1) * block_param_bytes;
  const int64_t bound = outside + inputs + one_block + other_grads;

  const int64_t plain = measure("none");
  const int64_t every = measure("every");
  const int64_t selective = measure("selective");
  std::printf("[ memory ] outside %.2f MiB, inputs %.2f MiB, one block %.2f MiB, other blocks' "
              "grads %.2f MiB -> bound %.2f MiB\n"
              "[ memory ] peak: no checkpointing %.2f MiB, every block %.2f MiB (%.1f%% of the "
              "bound), selective %.2f MiB\n",
              outside / 1048576.0, inputs / 1048576.0, one_block / 1048576.0,
              other_grads / 1048576.0, bound / 1048576.0, plain / 1048576.0, every / 1048576.0,
              100.0 * every / bound, selective / 1048576.0);
  EXPECT_LE(every, bound);
  EXPECT_LT(every, plain / 2) << "checkpointing every block should at least halve the peak here";
  EXPECT_LT(selective, plain);
}

}  // namespace
