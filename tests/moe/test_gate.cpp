// The gate against DeepSpeed-MoE's gating semantics (deepspeed/moe/sharded_moe.py: top1gating,
// top2gating, topkgating), on small cases computed by hand. Logits are log(p), so softmax(logits)
// is the probability table p written in each test. Python's torch is not available on the machine
// these were written on, so no values are taken from running DeepSpeed itself.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <tuple>
#include <vector>

#include "moe/gate.h"
#include "runtime/error.h"

namespace {

using strata::moe::DropPolicy;
using strata::moe::gate;
using strata::moe::gate_capacity;
using strata::moe::GateOptions;
using strata::moe::GateOutput;
using strata::moe::GroupCounts;
using strata::moe::NoisyGatePolicy;

torch::Tensor logits_of(const std::vector<std::vector<double>>& p,
                        torch::Dtype dtype = torch::kFloat) {
  std::vector<double> flat;
  for (const auto& row : p) flat.insert(flat.end(), row.begin(), row.end());
  const auto S = static_cast<int64_t>(p.size()), E = static_cast<int64_t>(p[0].size());
  return torch::tensor(flat, torch::kDouble).view({S, E}).log().to(dtype);
}

struct Route {
  int64_t token, expert, slot;
  double weight;
};

std::vector<Route> routes(const GateOutput& g) {
  std::vector<Route> r;
  for (int64_t i = 0; i < g.token.size(0); ++i) {
    r.push_back({g.token[i].item<int64_t>(), g.expert[i].item<int64_t>(), g.slot[i].item<int64_t>(),
                 g.weight[i].item<double>()});
  }
  return r;
}

// Expected kept routes, in output order (choice-major, token within a choice).
void expect_routes(const GateOutput& g, const std::vector<Route>& want, double tol = 1e-6) {
  const auto got = routes(g);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("route " + std::to_string(i));
    EXPECT_EQ(got[i].token, want[i].token);
    EXPECT_EQ(got[i].expert, want[i].expert);
    EXPECT_EQ(got[i].slot, want[i].slot);
    EXPECT_NEAR(got[i].weight, want[i].weight, tol);
  }
}

std::vector<int64_t> vec(const torch::Tensor& t) {
  const auto c = t.to(torch::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// Top-1 case: 6 tokens, 2 experts; tokens 0, 1, 3, 4 choose expert 0, tokens 2, 5 expert 1.
const std::vector<std::vector<double>> kTop1 = {{0.9, 0.1}, {0.6, 0.4}, {0.3, 0.7},
                                                {0.8, 0.2}, {0.55, 0.45}, {0.2, 0.8}};

GateOptions top1_options() {
  GateOptions o;
  o.k = 1;
  o.min_capacity = 0;
  o.use_rts = false;
  return o;
}

}  // namespace

TEST(Gate, CapacityRounding) {
  EXPECT_EQ(gate_capacity(10, 3, 1.0, 0), 4);  // ceil(3.33)
  EXPECT_EQ(gate_capacity(8, 4, 1.0, 0), 2);
  EXPECT_EQ(gate_capacity(8, 4, 1.0, 4), 4);  // raised to min_capacity
  EXPECT_EQ(gate_capacity(8, 4, 1.5, 0), 3);
  EXPECT_EQ(gate_capacity(8, 4, 0.1, 0), 1);  // ceil(0.2)
  EXPECT_EQ(gate_capacity(8, 4, 0.0, 0), 0);
  // DeepSpeed multiplies in float32: 12.5f * 1.2f = 15.000001f, so 16 (15 in exact arithmetic).
  EXPECT_EQ(gate_capacity(25, 2, 1.2, 0), 16);
  EXPECT_EQ(gate_capacity(35, 3, 0.6, 0), 8);

  // Through the gate: training uses capacity_factor, eval eval_capacity_factor; top-2 doubles it.
  const auto logits = torch::zeros({8, 4});
  GateOptions o = top1_options();
  o.capacity_factor = 1.0;
  o.eval_capacity_factor = 2.0;
  EXPECT_EQ(gate(logits, o).capacity, 2);
  o.training = false;
  EXPECT_EQ(gate(logits, o).capacity, 4);
  o.training = true;
  o.min_capacity = 3;
  EXPECT_EQ(gate(logits, o).capacity, 3);
  o.k = 2;
  o.min_capacity = 0;
  EXPECT_EQ(gate(logits, o).capacity, 4);  // ceil(8/4 * 1.0 * 2)
  o.k = 3;
  EXPECT_EQ(gate(logits, o).capacity, 6);  // ceil(8/4 * 1.0 * 3)
}

TEST(Gate, Top1DropsLowestTokensFirstWithoutRts) {
  const auto g = gate(logits_of(kTop1), top1_options());
  EXPECT_EQ(g.capacity, 3);  // ceil(6/2 * 1.0)
  EXPECT_EQ(g.num_experts, 2);
  EXPECT_EQ(vec(g.exp_counts), (std::vector<int64_t>{4, 2}));  // before the drop
  EXPECT_EQ(g.dropped, 1);                                     // token 4
  // Weights are the raw probabilities (top-1 does not renormalise).
  expect_routes(g,
                {{0, 0, 0, 0.9}, {1, 0, 1, 0.6}, {2, 1, 0, 0.7}, {3, 0, 2, 0.8}, {5, 1, 1, 0.8}});
  // l_aux = sum(me * ce) * E, me = [3.35, 2.65] / 6, ce = [4, 2] / 6.
  EXPECT_NEAR(g.l_aux.item<double>(), 2.0 * (3.35 * 4 + 2.65 * 2) / 36.0, 1e-6);
  EXPECT_FALSE(g.z_loss.defined());
}

TEST(Gate, Top1RandomTokenSelectionKeepsHighestPriority) {
  GateOptions o = top1_options();
  o.use_rts = true;
  std::set<std::vector<int64_t>> survivor_sets;
  for (uint64_t seed = 0; seed < 16; ++seed) {
    o.seed = seed;
    const auto g = gate(logits_of(kTop1), o);
    // The priorities: one uniform per token, the first draw of a generator seeded with `seed`.
    auto gen = at::detail::createCPUGenerator(seed);
    const auto prio = torch::rand({6}, gen, torch::kFloat);
    std::vector<int64_t> e0 = {0, 1, 3, 4};
    std::sort(e0.begin(), e0.end(),
              [&](int64_t a, int64_t b) { return prio[a].item<float>() > prio[b].item<float>(); });
    std::vector<int64_t> want(e0.begin(), e0.begin() + 3);
    std::sort(want.begin(), want.end());

    std::vector<int64_t> kept0, slots0;
    for (const auto& r : routes(g)) {
      if (r.expert == 0) {
        kept0.push_back(r.token);
        slots0.push_back(r.slot);
      }
    }
    EXPECT_EQ(kept0, want) << "seed " << seed;
    EXPECT_EQ(slots0, (std::vector<int64_t>{0, 1, 2}));  // slots in token order among survivors
    EXPECT_EQ(g.dropped, 1);
    EXPECT_EQ(vec(g.exp_counts), (std::vector<int64_t>{4, 2}));
    survivor_sets.insert(kept0);
    // Same seed, same routes.
    EXPECT_EQ(vec(gate(logits_of(kTop1), o).token), vec(g.token));
  }
  EXPECT_GE(survivor_sets.size(), 2u);  // the seed does change who survives
}

TEST(Gate, Top1UsedTokenMasksRoutes) {
  GateOptions o = top1_options();
  o.used_token = torch::tensor({0, 1, 1, 1, 1, 1});
  const auto g = gate(logits_of(kTop1), o);
  EXPECT_EQ(vec(g.exp_counts), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(g.dropped, 1);  // token 0, padding: it reaches no expert
  expect_routes(g, {{1, 0, 0, 0.6}, {2, 1, 0, 0.7}, {3, 0, 1, 0.8}, {4, 0, 2, 0.55},
                    {5, 1, 1, 0.8}});
  EXPECT_NEAR(g.l_aux.item<double>(), 2.0 * (3.35 * 3 + 2.65 * 2) / 36.0, 1e-6);
}

TEST(Gate, Top1RSampleNoiseIsSeededAndTrainingOnly) {
  const int64_t S = 64, E = 4;
  const auto logits = torch::zeros({S, E});
  GateOptions o = top1_options();
  o.min_capacity = 0;
  o.drop_tokens = false;
  o.noisy_gate_policy = NoisyGatePolicy::RSample;
  o.seed = 7;
  const auto g = gate(logits, o);
  // The choice is argmax(logits + Gumbel), the Gumbel noise the generator's first draw.
  auto gen = at::detail::createCPUGenerator(7);
  const float tiny = std::numeric_limits<float>::min(), eps = std::numeric_limits<float>::epsilon();
  const auto u = torch::rand({S, E}, gen, torch::kFloat).clamp(tiny, 1.0 - eps);
  const auto want = (logits - torch::log(-torch::log(u))).argmax(1);
  EXPECT_EQ(vec(g.expert), vec(want));
  const auto chosen = vec(g.expert);
  EXPECT_GT(std::set<int64_t>(chosen.begin(), chosen.end()).size(), 1u);
  EXPECT_EQ(vec(gate(logits, o).expert), vec(g.expert));
  o.seed = 8;
  EXPECT_NE(vec(gate(logits, o).expert), vec(g.expert));
  // Not in eval: every tie goes to expert 0.
  o.training = false;
  EXPECT_EQ(vec(gate(logits, o).expert), std::vector<int64_t>(S, 0));
}

// Top-2 case: 6 tokens, 3 experts. (1st, 2nd) choices: t0 (0,1), t1 (0,2), t2 (1,2), t3 (0,1),
// t4 (2,1), t5 (2,0): t5's 2nd is a tie between experts 0 and 1, which goes to expert 0.
const std::vector<std::vector<double>> kTop2 = {{0.5, 0.3, 0.2},   {0.6, 0.1, 0.3},
                                                {0.2, 0.5, 0.3},   {0.4, 0.35, 0.25},
                                                {0.1, 0.2, 0.7},   {0.3, 0.3, 0.4}};

TEST(Gate, Top2PositionsAndRenormalisation) {
  GateOptions o;
  o.k = 2;
  o.min_capacity = 0;
  o.top2_2nd_expert_sampling = false;
  o.capacity_factor = 0.5;  // capacity ceil(6/3 * 0.5 * 2) = 2
  auto g = gate(logits_of(kTop2), o);
  EXPECT_EQ(g.capacity, 2);
  EXPECT_EQ(vec(g.exp_counts), (std::vector<int64_t>{4, 4, 4}));  // 1st + 2nd, before drops
  // 1st choices take positions in token order: e0 t0 0, t1 1, t3 2 (dropped); e1 t2 0;
  // e2 t4 0, t5 1. 2nd choices start after the expert's 1st choices: e1 t0 1, t3 2, t4 3;
  // e2 t1 2, t2 3; e0 t5 3: only t0's survives. Weights: g / (sum of the kept gs).
  EXPECT_EQ(g.dropped, 6);
  expect_routes(g, {{0, 0, 0, 0.5 / 0.8}, {1, 0, 1, 1.0}, {2, 1, 0, 1.0}, {4, 2, 0, 1.0},
                    {5, 2, 1, 1.0}, {0, 1, 1, 0.3 / 0.8}});
  // l_aux = mean(me * ce) * E * E with ce counting 1st choices only: me = [2.1, 1.75, 2.15] / 6,
  // ce = [3, 1, 2] / 6.
  EXPECT_NEAR(g.l_aux.item<double>(), 9.0 * (2.1 * 3 + 1.75 + 2.15 * 2) / 108.0, 1e-6);

  o.capacity_factor = 0.75;  // capacity 3
  g = gate(logits_of(kTop2), o);
  EXPECT_EQ(g.capacity, 3);
  EXPECT_EQ(g.dropped, 3);  // t4's 2nd (e1 3), t2's 2nd (e2 3), t5's 2nd (e0 3)
  expect_routes(g, {{0, 0, 0, 0.5 / 0.8}, {1, 0, 1, 0.6 / 0.9}, {2, 1, 0, 1.0},
                    {3, 0, 2, 0.4 / 0.75}, {4, 2, 0, 1.0}, {5, 2, 1, 1.0}, {0, 1, 1, 0.3 / 0.8},
                    {1, 2, 2, 0.3 / 0.9}, {3, 1, 2, 0.35 / 0.75}});
}

TEST(Gate, Top2SecondExpertSampling) {
  const int64_t S = 32, E = 4;
  const auto logits = torch::zeros({S, E});
  GateOptions o;
  o.k = 2;
  o.drop_tokens = false;
  o.seed = 3;
  const auto g = gate(logits, o);
  EXPECT_EQ(g.dropped, 0);
  // 1st: argmax of the (flat) gates, expert 0; 2nd: argmax of logits + Gumbel without expert 0.
  auto gen = at::detail::createCPUGenerator(3);
  const float tiny = std::numeric_limits<float>::min(), eps = std::numeric_limits<float>::epsilon();
  const auto u = torch::rand({S, E}, gen, torch::kFloat).clamp(tiny, 1.0 - eps);
  auto noisy = logits - torch::log(-torch::log(u));
  noisy.select(1, 0).fill_(-std::numeric_limits<float>::infinity());
  const auto experts = vec(g.expert);
  EXPECT_EQ(std::vector<int64_t>(experts.begin(), experts.begin() + S), std::vector<int64_t>(S, 0));
  EXPECT_EQ(std::vector<int64_t>(experts.begin() + S, experts.end()), vec(noisy.argmax(1)));
  EXPECT_EQ(vec(gate(logits, o).expert), experts);  // seeded
  // Every weight is 1/2 (equal gates, both kept).
  EXPECT_TRUE(torch::allclose(g.weight, torch::full({2 * S}, 0.5)));
  // Applied in eval too (as DeepSpeed); off, the 2nd is the lowest other expert.
  o.training = false;
  EXPECT_EQ(vec(gate(logits, o).expert), experts);
  o.top2_2nd_expert_sampling = false;
  const auto plain = vec(gate(logits, o).expert);
  EXPECT_EQ(std::vector<int64_t>(plain.begin() + S, plain.end()), std::vector<int64_t>(S, 1));
}

// Top-3 case: 4 tokens, 4 experts; choices t0 {0,1,2}, t1 {3,2,1}, t2 {1,2,0}, t3 {2,0,3}.
// Expert 2 is chosen by all 4 tokens with probabilities 0.2, 0.3, 0.3, 0.4; capacity is 3.
const std::vector<std::vector<double>> kTop3 = {
    {0.4, 0.3, 0.2, 0.1}, {0.1, 0.2, 0.3, 0.4}, {0.25, 0.35, 0.3, 0.1}, {0.3, 0.1, 0.4, 0.2}};

TEST(Gate, TopKDropPolicies) {
  GateOptions o;
  o.k = 3;
  o.min_capacity = 0;
  o.drop_policy = DropPolicy::Probs;
  auto g = gate(logits_of(kTop3), o);
  EXPECT_EQ(g.capacity, 3);  // ceil(4/4 * 1.0 * 3)
  EXPECT_EQ(vec(g.exp_counts), (std::vector<int64_t>{3, 3, 4, 2}));
  EXPECT_EQ(g.dropped, 1);
  // l_aux = mean(me * ce) * E * E / k: me = [1.05, 0.95, 1.2, 0.8] / 4, ce = [3, 3, 4, 2] / 4.
  EXPECT_NEAR(g.l_aux.item<double>(), 16.0 / 3.0 * (12.4 / 16.0) / 4.0, 1e-6);
  // Probs: expert 2 keeps t3, t1, t2 (drops t0, the least probable); slots follow token order.
  // t0 renormalises over its two kept routes.
  expect_routes(g, {{0, 0, 0, 0.4 / 0.7}, {1, 3, 0, 0.4 / 0.9}, {2, 1, 2, 0.35 / 0.9},
                    {3, 2, 2, 0.4 / 0.9}, {0, 1, 0, 0.3 / 0.7}, {1, 2, 0, 0.3 / 0.9},
                    {2, 2, 1, 0.3 / 0.9}, {3, 0, 2, 0.3 / 0.9}, {1, 1, 1, 0.2 / 0.9},
                    {2, 0, 1, 0.25 / 0.9}, {3, 3, 1, 0.2 / 0.9}});

  // Position: expert 2 keeps the first three tokens, t3 loses its 1st choice.
  o.drop_policy = DropPolicy::Position;
  g = gate(logits_of(kTop3), o);
  EXPECT_EQ(g.dropped, 1);
  EXPECT_EQ(vec(g.exp_counts), (std::vector<int64_t>{3, 3, 4, 2}));
  expect_routes(g, {{0, 0, 0, 0.4 / 0.9}, {1, 3, 0, 0.4 / 0.9}, {2, 1, 2, 0.35 / 0.9},
                    {0, 1, 0, 0.3 / 0.9}, {1, 2, 1, 0.3 / 0.9}, {2, 2, 2, 0.3 / 0.9},
                    {3, 0, 2, 0.3 / 0.5}, {0, 2, 0, 0.2 / 0.9}, {1, 1, 1, 0.2 / 0.9},
                    {2, 0, 1, 0.25 / 0.9}, {3, 3, 1, 0.2 / 0.5}});
}

TEST(Gate, TopKTiesKeepLowestToken) {
  // Three identical tokens, k = E = 3, capacity 1: every expert keeps token 0 under both policies.
  const std::vector<std::vector<double>> p(3, {0.5, 0.3, 0.2});
  GateOptions o;
  o.k = 3;
  o.min_capacity = 0;
  o.capacity_factor = 0.3;  // ceil(3/3 * 0.9) = 1
  for (auto policy : {DropPolicy::Probs, DropPolicy::Position}) {
    o.drop_policy = policy;
    const auto g = gate(logits_of(p), o);
    EXPECT_EQ(g.capacity, 1);
    EXPECT_EQ(g.dropped, 6);
    expect_routes(g, {{0, 0, 0, 0.5}, {0, 1, 0, 0.3}, {0, 2, 0, 0.2}});
  }
}

TEST(Gate, NoDropCapacityIsTheLargestLoad) {
  GateOptions o = top1_options();
  o.drop_tokens = false;
  auto g = gate(logits_of(kTop1), o);
  EXPECT_EQ(g.capacity, 4);
  EXPECT_EQ(g.dropped, 0);
  EXPECT_EQ(vec(g.slot), (std::vector<int64_t>{0, 1, 0, 2, 3, 1}));
  // The agreed (group-wide) capacity; top-1 caps it at the group's token count, top-2/top-k do
  // not.
  GroupCounts asked;
  int64_t group_tokens = 6;
  o.agree_over_group = [&](GroupCounts local) {
    asked = local;
    return GroupCounts{group_tokens, 7};
  };
  g = gate(logits_of(kTop1), o);
  EXPECT_EQ(asked.tokens, 6);
  EXPECT_EQ(asked.load, 4);
  EXPECT_EQ(g.capacity, 6);
  group_tokens = 10;  // another rank routes more tokens: its count caps top-1, not this rank's 6
  g = gate(logits_of(kTop1), o);
  EXPECT_EQ(g.capacity, 7);
  o.k = 2;
  o.top2_2nd_expert_sampling = false;
  g = gate(logits_of(kTop2), o);
  EXPECT_EQ(asked.load, 4);
  EXPECT_EQ(g.capacity, 7);
  EXPECT_EQ(g.dropped, 0);
  EXPECT_EQ(g.token.size(0), 12);
  o.k = 3;
  o.agree_over_group = nullptr;
  g = gate(logits_of(kTop3), o);
  EXPECT_EQ(g.capacity, 4);
  EXPECT_EQ(g.dropped, 0);
  // An agreement below this rank's own counts would silently drop tokens: refused.
  o.agree_over_group = [](GroupCounts local) { return GroupCounts{local.tokens, local.load - 1}; };
  EXPECT_THROW(gate(logits_of(kTop3), o), strata::Error);
  o.agree_over_group = [](GroupCounts local) { return GroupCounts{local.tokens - 1, local.load}; };
  EXPECT_THROW(gate(logits_of(kTop3), o), strata::Error);
}

// With drop_tokens the capacity comes from the group's token count (the largest of the ranks),
// and this rank's load is not read (0: no host sync).
TEST(Gate, DropTokensCapacityIsFromTheGroupsTokenCount) {
  GateOptions o = top1_options();
  GroupCounts asked{-1, -1};
  o.agree_over_group = [&](GroupCounts local) {
    asked = local;
    return GroupCounts{40, 0};
  };
  const auto g = gate(logits_of(kTop1), o);
  EXPECT_EQ(asked.tokens, 6);
  EXPECT_EQ(asked.load, 0);
  EXPECT_EQ(g.capacity, gate_capacity(40, 2, o.capacity_factor, o.min_capacity));  // 20
  EXPECT_EQ(g.dropped, 0);
  // min_capacity is DeepSpeed's bound on the token count, here the group's: a rank with a short
  // batch does not throw alone (its group would wait for it in the next collective).
  o.min_capacity = 8;
  EXPECT_EQ(gate(logits_of(kTop1), o).capacity, 20);
  o.agree_over_group = nullptr;
  EXPECT_THROW(gate(logits_of(kTop1), o), strata::Error);
}

TEST(Gate, RouterZLoss) {
  GateOptions o = top1_options();
  o.z_loss_coef = 0.01;
  auto logits = torch::tensor({0.0, 0.0, std::log(3.0), 0.0}).view({2, 2}).requires_grad_();
  const auto g = gate(logits, o);
  // logsumexp rows: ln 2 and ln 4 = 2 ln 2; mean of squares 2.5 ln^2 2.
  const double ln2 = std::log(2.0);
  EXPECT_NEAR(g.z_loss.item<double>(), 0.01 * 2.5 * ln2 * ln2, 1e-7);
  g.z_loss.backward();
  // d/dlogits = coef * 2 * lse_s * softmax_s / S.
  const auto want = torch::tensor({0.01 * ln2 * 0.5, 0.01 * ln2 * 0.5, 0.01 * 2 * ln2 * 0.75,
                                   0.01 * 2 * ln2 * 0.25}).view({2, 2});
  EXPECT_TRUE(torch::allclose(logits.grad(), want, 1e-5, 1e-7)) << logits.grad();
}

TEST(Gate, GradientsMatchFiniteDifferences) {
  torch::manual_seed(0);
  const int64_t S = 6, E = 4;
  const auto base = torch::randn({S, E}, torch::kDouble);
  for (int64_t k : {1, 2, 3}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    GateOptions o;
    o.k = k;
    o.min_capacity = 0;
    o.capacity_factor = 0.5;  // some drops, so renormalisation over kept routes is exercised
    o.seed = 11;
    o.z_loss_coef = 0.1;
    const auto c = torch::linspace(0.5, 2.0, S * k, torch::kDouble);
    // A loss through every differentiable output; the routing is fixed by the seed.
    auto loss = [&](const torch::Tensor& x) {
      const auto g = gate(x, o);
      return (g.weight * c.index({torch::indexing::Slice(0, g.weight.size(0))})).sum() +
             0.3 * g.l_aux + g.z_loss;
    };
    auto x = base.clone().requires_grad_();
    const auto g = gate(x, o);
    ASSERT_TRUE(g.weight.requires_grad());
    ASSERT_TRUE(g.l_aux.requires_grad());
    EXPECT_GT(g.dropped, 0);
    loss(x).backward();
    const double h = 1e-6;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t e = 0; e < E; ++e) {
        auto xp = base.clone(), xm = base.clone();
        xp[s][e] += h;
        xm[s][e] -= h;
        const double fd = (loss(xp).item<double>() - loss(xm).item<double>()) / (2 * h);
        EXPECT_NEAR(x.grad()[s][e].item<double>(), fd, 1e-6) << "s " << s << " e " << e;
      }
    }
  }
}

// gate_routes(), the layer's fixed-size form: every route present, the kept ones exactly gate()'s
// lists, kept_counts and dropped what those lists count (bincount, another way), and each
// expert's slots dense from 0 (the grouped expert kernel relies on it).
TEST(Gate, FixedSizeFormHoldsTheKeptRoutes) {
  struct Cfg {
    int64_t k;
    bool rts, used;
    DropPolicy drop;
  };
  const Cfg cfgs[] = {{1, true, false, DropPolicy::Probs}, {1, false, false, DropPolicy::Probs},
                      {1, true, true, DropPolicy::Probs},  {2, false, false, DropPolicy::Probs},
                      {3, false, false, DropPolicy::Probs}, {3, false, false, DropPolicy::Position}};
  torch::manual_seed(5);
  for (const auto& cfg : cfgs) {
    const int64_t S = 40, E = 5;
    const auto logits = torch::randn({S, E});
    GateOptions o;
    o.k = cfg.k;
    o.use_rts = cfg.rts;
    o.drop_policy = cfg.drop;
    o.capacity_factor = 0.6;
    o.min_capacity = 0;
    o.seed = 17;
    if (cfg.used) o.used_token = torch::randint(0, 2, {S});
    const auto r = strata::moe::gate_routes(logits, o);
    const auto g = gate(logits, o);
    const std::string what = "k " + std::to_string(cfg.k);
    ASSERT_EQ(r.token.size(0), S * cfg.k) << what;
    const auto kept = r.kept.nonzero().squeeze(1);
    EXPECT_TRUE(torch::equal(r.token.index_select(0, kept), g.token)) << what;
    EXPECT_TRUE(torch::equal(r.expert.index_select(0, kept), g.expert)) << what;
    EXPECT_TRUE(torch::equal(r.slot.index_select(0, kept), g.slot)) << what;
    EXPECT_TRUE(torch::equal(r.kept_counts, torch::bincount(g.expert, {}, E))) << what;
    // Over capacity, and padding (used_token 0): every route that reaches no expert.
    EXPECT_EQ(r.dropped.item<int64_t>(), S * cfg.k - g.token.size(0)) << what;
    EXPECT_GT(g.dropped, 0) << what << ": the case should drop routes";
    for (int64_t e = 0; e < E; ++e) {
      const auto slots = std::get<0>(g.slot.masked_select(g.expert.eq(e)).sort());
      EXPECT_TRUE(torch::equal(slots, torch::arange(slots.size(0)))) << what << " expert " << e;
    }
  }
}

TEST(Gate, BadInputIsAnError) {
  const auto logits = torch::zeros({8, 4});
  GateOptions o;
  o.k = 5;  // more than E
  EXPECT_THROW(gate(logits, o), strata::Error);
  o.k = 0;
  EXPECT_THROW(gate(logits, o), strata::Error);
  o.k = 1;
  o.min_capacity = 9;  // more than the tokens (DeepSpeed's top-1 assert)
  EXPECT_THROW(gate(logits, o), strata::Error);
  o.min_capacity = 4;
  o.capacity_factor = -1;
  EXPECT_THROW(gate(logits, o), strata::Error);
  o.capacity_factor = 1;
  EXPECT_THROW(gate(torch::zeros({8}), o), strata::Error);
  EXPECT_THROW(gate(torch::zeros({8, 4}, torch::kHalf), o), strata::Error);
  o.used_token = torch::ones({7});
  EXPECT_THROW(gate(logits, o), strata::Error);
  o.k = 2;
  o.used_token = torch::ones({8});
  EXPECT_THROW(gate(logits, o), strata::Error);
  try {
    o.used_token = torch::Tensor();
    o.k = 5;
    gate(logits, o);
    ADD_FAILURE() << "k > E accepted";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("k = 5"), std::string::npos) << e.what();
  }
}
