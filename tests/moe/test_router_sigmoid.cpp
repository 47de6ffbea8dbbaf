// The sigmoid router (DeepSeek-V3, moe/gate.h "The sigmoid router") on cases computed by hand:
// the bias chooses and never weighs, group-limited routing, the combine weights' normalisation
// and scale, the sequence-wise balance loss; and the layer's side of it: loads counted per
// training forward, the bias update, shared experts added to the routed output.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moe/gate.h"
#include "moe/layer.h"
#include "runtime/error.h"

namespace {

using strata::moe::gate;
using strata::moe::GateOptions;
using strata::moe::GateOutput;
using strata::moe::ScoreFunc;

// Logits whose sigmoid is the table s: log(s / (1 - s)).
torch::Tensor sigmoid_logits_of(const std::vector<std::vector<double>>& s) {
  std::vector<double> flat;
  for (const auto& row : s) flat.insert(flat.end(), row.begin(), row.end());
  const auto t = torch::tensor(flat, torch::kDouble).view({int64_t(s.size()), int64_t(s[0].size())});
  return (t / (1 - t)).log().to(torch::kFloat);
}

GateOptions sigmoid_options(int64_t k) {
  GateOptions o;
  o.k = k;
  o.score_func = ScoreFunc::Sigmoid;
  o.drop_tokens = false;  // dropless: capacity is the largest load
  return o;
}

struct SigmoidRoute {
  int64_t token, expert, slot;
  double weight;
};

void expect_sigmoid_routes(const GateOutput& g, const std::vector<SigmoidRoute>& want) {
  ASSERT_EQ(g.token.size(0), int64_t(want.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("route " + std::to_string(i));
    EXPECT_EQ(g.token[int64_t(i)].item<int64_t>(), want[i].token);
    EXPECT_EQ(g.expert[int64_t(i)].item<int64_t>(), want[i].expert);
    EXPECT_EQ(g.slot[int64_t(i)].item<int64_t>(), want[i].slot);
    EXPECT_NEAR(g.weight[int64_t(i)].item<double>(), want[i].weight, 1e-6);
  }
}

const std::vector<std::vector<double>> kTwoTokens = {{0.9, 0.8, 0.3, 0.2}, {0.1, 0.6, 0.7, 0.5}};

// Without a bias: top-2 of s; weights s / (sum of the two chosen).
TEST(SigmoidRouter, ChoosesTheTopScoresAndNormalisesTheirWeights) {
  const auto g = gate(sigmoid_logits_of(kTwoTokens), sigmoid_options(2));
  // Choice-major: token 0 -> 0 (0.9), token 1 -> 2 (0.7); then token 0 -> 1 (0.8), token 1 -> 1.
  // Slots in token order within an expert: expert 1 has token 0 (slot 0), token 1 (slot 1).
  expect_sigmoid_routes(g, {{0, 0, 0, 0.9 / 1.7}, {1, 2, 0, 0.7 / 1.3}, {0, 1, 0, 0.8 / 1.7},
                    {1, 1, 1, 0.6 / 1.3}});
  EXPECT_EQ(g.capacity, 2);  // dropless: the largest load (expert 1)
  EXPECT_EQ(g.dropped, 0);
  EXPECT_TRUE(torch::equal(g.exp_counts, torch::tensor({1, 2, 1, 0}, torch::kLong)));
}

// The bias moves the choice, the weights stay the unbiased scores of what was chosen.
TEST(SigmoidRouter, TheBiasChoosesAndNeverWeighs) {
  auto o = sigmoid_options(2);
  o.expert_bias = torch::tensor({0.0, -0.6, 0.55, 0.0}, torch::kFloat);
  const auto g = gate(sigmoid_logits_of(kTwoTokens), o);
  // token 0: s + b = [0.9, 0.2, 0.85, 0.2] -> 0, 2; token 1: [0.1, 0.0, 1.25, 0.5] -> 2, 3.
  expect_sigmoid_routes(g, {{0, 0, 0, 0.9 / 1.2}, {1, 2, 1, 0.7 / 1.2}, {0, 2, 0, 0.3 / 1.2},
                    {1, 3, 0, 0.5 / 1.2}});
  EXPECT_TRUE(torch::equal(g.exp_counts, torch::tensor({1, 0, 2, 1}, torch::kLong)));

  // norm_topk_prob off and route_scale 2.5: the chosen scores times 2.5.
  o.norm_topk_prob = false;
  o.route_scale = 2.5;
  expect_sigmoid_routes(gate(sigmoid_logits_of(kTwoTokens), o),
                {{0, 0, 0, 2.25}, {1, 2, 1, 1.75}, {0, 2, 0, 0.75}, {1, 3, 0, 1.25}});
}

// Group-limited: 6 experts in 3 groups {0,1} {2,3} {4,5}; a group's score is the sum of its two
// best s + b; each token routes within its topk_group = 1 best group.
TEST(SigmoidRouter, RoutesWithinTheBestGroups) {
  const std::vector<std::vector<double>> s = {{0.9, 0.1, 0.8, 0.7, 0.6, 0.65},
                                              {0.9, 0.1, 0.8, 0.7, 0.6, 0.65}};
  auto o = sigmoid_options(2);
  o.n_group = 3;
  o.topk_group = 1;
  // Token 0: groups 1.0, 1.5, 1.25 -> group 1 -> experts 2 (0.8), 3 (0.7), not expert 0 (0.9).
  // With a bias of -0.5 on group 1: 1.0, 0.5, 1.25 -> group 2 -> 5 (0.65), 4 (0.6).
  auto g = gate(sigmoid_logits_of(s), o);
  expect_sigmoid_routes(g, {{0, 2, 0, 0.8 / 1.5}, {1, 2, 1, 0.8 / 1.5}, {0, 3, 0, 0.7 / 1.5},
                    {1, 3, 1, 0.7 / 1.5}});
  o.expert_bias = torch::tensor({0.0, 0.0, -0.5, -0.5, 0.0, 0.0}, torch::kFloat);
  g = gate(sigmoid_logits_of(s), o);
  expect_sigmoid_routes(g, {{0, 5, 0, 0.65 / 1.25}, {1, 5, 1, 0.65 / 1.25}, {0, 4, 0, 0.6 / 1.25},
                    {1, 4, 1, 0.6 / 1.25}});
  // Two groups allowed: groups 0 (1.0) and 2 (1.25) -> experts 0 (0.9) and 5 (0.65).
  o.topk_group = 2;
  g = gate(sigmoid_logits_of(s), o);
  expect_sigmoid_routes(g, {{0, 0, 0, 0.9 / 1.55}, {1, 0, 1, 0.9 / 1.55}, {0, 5, 0, 0.65 / 1.55},
                    {1, 5, 1, 0.65 / 1.55}});
}

// DeepSeek-V3's sequence-wise balance loss, two sequences of two tokens, 2 experts, top-1:
// seq 0: shares [0.8 0.2], [0.5 0.5] -> P = [0.65 0.35], both tokens to expert 0 (a tie goes to
// the lower index) -> f = 2/(1*2) x [2 0] = [2 0] -> 1.3; seq 1: shares [0.25 0.75], [0.5 0.5]
// -> P = [0.375 0.625], routes 1 and 0 -> f = [1 1] -> 1.0; l_aux = mean = 1.15.
TEST(SigmoidRouter, SequenceWiseBalanceLoss) {
  auto o = sigmoid_options(1);
  o.sequence_length = 2;
  const auto logits = sigmoid_logits_of({{0.8, 0.2}, {0.6, 0.6}, {0.3, 0.9}, {0.5, 0.5}}).requires_grad_();
  const auto g = gate(logits, o);
  EXPECT_NEAR(g.l_aux.item<double>(), 1.15, 1e-6);
  g.l_aux.backward();
  EXPECT_TRUE(logits.grad().defined());
  EXPECT_GT(logits.grad().abs().sum().item<double>(), 0.0);
  // One sequence of all four tokens: P = mean of the four shares = [0.5125 0.4875], routes
  // 0, 0, 1, 0 -> f = 2/4 x [3 1] -> 0.75 * 0.5125 + 0.25 * 0.4875 = 0.5062...
  o.sequence_length = 0;
  EXPECT_NEAR(gate(logits.detach(), o).l_aux.item<double>(),
              1.5 * 0.5125 + 0.5 * 0.4875, 1e-6);
}

TEST(SigmoidRouter, BadOptionsAreNamed) {
  auto o = sigmoid_options(2);
  o.n_group = 3;  // 4 experts do not split into 3 groups
  EXPECT_THROW(gate(sigmoid_logits_of(kTwoTokens), o), strata::Error);
  o = sigmoid_options(2);
  o.expert_bias = torch::zeros({3});
  EXPECT_THROW(gate(sigmoid_logits_of(kTwoTokens), o), strata::Error);
  o = sigmoid_options(2);
  o.sequence_length = 3;  // does not divide 2 tokens
  EXPECT_THROW(gate(sigmoid_logits_of(kTwoTokens), o), strata::Error);
}

strata::moe::MoEOptions layer_options(int64_t shared) {
  strata::moe::MoEOptions o;
  o.hidden_size = 8;
  o.ffn_size = 16;
  o.num_experts = 4;
  o.k = 2;
  o.drop_tokens = false;
  o.score_func = ScoreFunc::Sigmoid;
  o.bias_update_speed = 0.01;
  o.n_shared_experts = shared;
  o.seed = 7;
  return o;
}

// Loads count the routes of training forwards only; the update moves each bias by the speed
// toward balance (loads [3 1 2 2]: mean 2 -> -1, +1, 0, 0).
TEST(SigmoidRouter, LayerCountsLoadsAndMovesTheBiasTowardBalance) {
  strata::moe::MoE layer(layer_options(0));
  EXPECT_TRUE(torch::equal(layer->expert_bias(), torch::zeros({4})));
  const auto x = torch::randn({2, 5, 8});
  layer->forward(x);
  layer->forward(x);
  layer->eval();
  layer->forward(x);  // not counted
  const auto load = layer->take_expert_load();
  EXPECT_EQ(load.sum().item<int64_t>(), 2 * 10 * 2);  // 2 forwards x 10 tokens x k = 2
  EXPECT_EQ(layer->take_expert_load().sum().item<int64_t>(), 0);
  layer->update_expert_bias(torch::tensor({3, 1, 2, 2}, torch::kLong));
  EXPECT_TRUE(torch::allclose(layer->expert_bias(), torch::tensor({-0.01f, 0.01f, 0.0f, 0.0f})));
  layer->update_expert_bias(torch::tensor({3, 1, 2, 2}, torch::kLong));
  EXPECT_TRUE(torch::allclose(layer->expert_bias(), torch::tensor({-0.02f, 0.02f, 0.0f, 0.0f})));
  EXPECT_THROW(layer->set_expert_bias(torch::zeros({3})), strata::Error);
}

// Shared experts: the layer's output is the same layer's without them (the same named draws of
// gate and experts) plus the shared MLP on every token; with 2 shared experts it is one MLP twice
// the expert width, an ordinary parameter (not named "experts").
TEST(SigmoidRouter, SharedExpertsAreAddedToTheRoutedOutput) {
  strata::moe::MoE with(layer_options(2)), without(layer_options(0));
  const auto x = torch::randn({3, 4, 8});
  const auto y = with->forward(x), routed = without->forward(x);
  const auto shared = with->shared_experts.forward<torch::Tensor>(x.reshape({-1, 8})).view(x.sizes());
  EXPECT_TRUE(torch::allclose(y, routed + shared, 1e-5, 1e-6));
  bool found = false;
  for (const auto& p : with->named_parameters()) {
    if (p.key().rfind("shared_experts.", 0) != 0) continue;
    found = true;
    EXPECT_FALSE(strata::moe::is_expert_parameter_name(p.key())) << p.key();
    if (p.key() == "shared_experts.fc1.weight") EXPECT_EQ(p.value().size(0), 2 * 16);
  }
  EXPECT_TRUE(found);
}

}  // namespace

namespace {

// Dropless at ep_size 1 with the grouped kernel: no capacity is read (no host sync on a GPU);
// every route is kept and the output equals the batched kernel's over the capacity-padded buffer.
TEST(SigmoidRouter, DroplessWithTheGroupedKernelReadsNoCapacity) {
  strata::moe::MoE packed(layer_options(1)), padded(layer_options(1));
  packed->experts->set_kernel(strata::moe::ExpertKernel::Grouped);
  padded->experts->set_kernel(strata::moe::ExpertKernel::Batched);
  const auto x = torch::randn({2, 6, 8});
  const auto a = packed->forward(x), b = padded->forward(x);
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6));
  EXPECT_EQ(packed->last().capacity, 2 * 6 * 2);  // the S * k bound: no buffer of that size
  EXPECT_EQ(packed->last().dropped_count(), 0);
  EXPECT_LT(padded->last().capacity, 2 * 6 * 2);  // the largest load, read for the padded buffer
}

}  // namespace
