// The example GPT's checkpoint policies against the same model without checkpointing: the loss
// and every parameter's gradient, in one process, without the engine.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "examples/gpt.h"

namespace {

using strata::examples::GPT;
using strata::examples::GPTConfig;

struct Grads {
  double loss = 0;
  std::vector<std::pair<std::string, torch::Tensor>> grads;
};

Grads run(const std::string& model, const std::string& policy, uint64_t seed = 7) {
  auto config = GPTConfig::by_name(model);
  config.checkpointing = policy;
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
  for (size_t i = 0; i < a.grads.size(); ++i) {
    const auto& [name, ga] = a.grads[i];
    const auto& gb = b.grads[i].second;
    ASSERT_EQ(ga.defined(), gb.defined()) << what << ": " << name;
    if (!ga.defined()) continue;
    const double diff = (ga - gb).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << what << ": " << name << " differs by " << diff;
  }
}

TEST(CheckpointGPT, EveryBlockAndSelectiveGiveTheGradientsOfThePlainModelWithDropout) {
  const auto plain = run("tiny-dropout", "none");
  for (const std::string policy : {"every", "every:2", "selective"})
    expect_same(plain, run("tiny-dropout", policy), policy);
}

}  // namespace
