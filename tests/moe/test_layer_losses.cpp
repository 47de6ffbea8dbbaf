// The MoE layer's losses, masks and autocast, in one process: loss() weighs l_aux and the router
// z-loss each by its own coefficient, both reach the gate weight (against the gate's formulas
// written out), used_token through forward against the token-by-token reference, and the router
// in float32 under LibTorch's CPU autocast.
#include <gtest/gtest.h>

#include <string>

#include "moe/layer.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "tests/moe/layer_reference.h"

namespace {

using namespace strata::moe;
using namespace strata::test::moe_layer;
namespace F = torch::nn::functional;

// used_token through forward (DeepSpeed's MoE(..., used_token)): padding takes no capacity and
// gets no output; the other tokens are routed as the gate routes them under the same mask.
TEST(MoeLayer, UsedTokenThroughForwardMasksPadding) {
  auto o = options(1, true);
  o.capacity_factor = 0.5;  // drops: the padding's freed capacity goes to the used tokens
  MoE m(o);
  Reference ref(m);
  torch::manual_seed(6);
  const auto x = torch::randn({2, 12, kD});
  auto used = torch::ones({2, 12}, torch::kLong);
  used.narrow(1, 8, 4).zero_();  // the last 4 tokens of each sequence are padding
  m->set_call_index(2);
  const auto y = m->forward(x, used).reshape({24, kD});
  const auto [y_ref, g] = ref.forward(o, x.reshape({24, kD}), 2, true, used.reshape({-1}));
  expect_close(y, y_ref, "output with used_token");
  EXPECT_TRUE(torch::equal(m->last().exp_counts, g.exp_counts));
  EXPECT_EQ(m->last().exp_counts.sum().item<int64_t>(), 16);
  EXPECT_EQ(m->last().dropped_count(), g.dropped);
  const auto padding = used.reshape({-1}).eq(0);
  EXPECT_EQ(y.index({padding}).abs().max().item<double>(), 0.0);
  EXPECT_THROW(m->forward(x, torch::ones({2, 11})), strata::Error);
  // Through AnyModule (a block's feed-forward), forward(x) alone.
  torch::nn::AnyModule any(m);
  EXPECT_EQ(any.forward<torch::Tensor>(x).sizes(), x.sizes());
}

// LibTorch's CPU autocast in bf16 while it lives (torch_autocast's forward).
struct CpuAutocastBf16 {
  CpuAutocastBf16() {
    strata::compat::set_autocast_dtype(c10::DeviceType::CPU, torch::kBFloat16);
    strata::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
  }
  ~CpuAutocastBf16() {
    strata::compat::set_autocast_enabled(c10::DeviceType::CPU, false);
    at::autocast::clear_cache();
  }
};

// Under autocast the router runs in float32 (as Megatron's): the same routes, l_aux and drops as
// without autocast, bit for bit, while the experts multiply in bf16 (their output within bf16's
// rounding of the float32 one). Before, autocast recast the gate's product to bf16 and the gate
// refused the bf16 logits.
TEST(MoeLayer, RouterRunsInFloat32UnderAutocast) {
  for (int64_t k : {1, 2}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    auto o = options(k, true);
    o.capacity_factor = 0.75;  // drops: which routes survive depends on the exact gate values
    o.noisy_gate_policy = NoisyGatePolicy::Jitter;
    MoE m(o);
    torch::manual_seed(4);
    const auto x = torch::randn({24, kD});
    m->set_call_index(3);
    const auto y32 = m->forward(x).detach();
    const auto l_aux32 = m->last().l_aux.detach().clone();
    const auto counts32 = m->last().exp_counts.clone();
    const int64_t dropped32 = m->last().dropped_count();
    ASSERT_GT(dropped32, 0);

    const auto xg = x.clone().requires_grad_(true);
    torch::Tensor y16;
    {
      CpuAutocastBf16 autocast;
      m->set_call_index(3);
      y16 = m->forward(xg);
    }
    EXPECT_EQ(y16.scalar_type(), torch::kBFloat16);  // the experts' products
    EXPECT_TRUE(torch::equal(m->last().l_aux.detach(), l_aux32));
    EXPECT_TRUE(torch::equal(m->last().exp_counts, counts32));
    EXPECT_EQ(m->last().dropped_count(), dropped32);
    expect_close(y16.to(torch::kFloat), y32, "output under autocast", 2e-2);
    (y16.to(torch::kFloat).pow(2).sum() + m->last().l_aux).backward();
    EXPECT_EQ(m->gate->weight.grad().scalar_type(), torch::kFloat);
    EXPECT_GT(m->gate->weight.grad().abs().sum().item<double>(), 0.0);
    EXPECT_GT(m->experts->w1.grad().abs().sum().item<double>(), 0.0);
  }
}

// loss() weighs l_aux by aux_loss_coef and the z-loss by router_z_loss_coef alone: with
// aux_loss_coef 0 the z-loss still trains the gate (it was summed into what programs multiplied
// by aux_loss_coef), and with router_z_loss_coef 0 only the weighed l_aux is left.
TEST(MoeLayer, EachAuxiliaryCoefficientActsAlone) {
  auto o = options(2, true);
  o.aux_loss_coef = 0.0;
  o.router_z_loss_coef = 0.1;
  MoE m(o);
  torch::manual_seed(3);
  const auto x = torch::randn({32, kD});
  m->forward(x);
  const auto z_ref = torch::logsumexp(F::linear(x, m->gate->weight.detach()), 1).pow(2).mean() * 0.1;
  EXPECT_NEAR(m->loss().item<double>(), z_ref.item<double>(), 1e-6);
  m->loss().backward();
  EXPECT_GT(m->gate->weight.grad().abs().sum().item<double>(), 0.0);

  o.aux_loss_coef = 0.3;
  o.router_z_loss_coef = 0.0;
  MoE n(o);
  n->forward(x);
  EXPECT_FALSE(n->last().z_loss.defined());
  EXPECT_NEAR(n->loss().item<double>(), 0.3 * n->last().l_aux.item<double>(), 1e-7);
  EXPECT_GT(n->last().l_aux.item<double>(), 0.5);  // l_aux is about 1 when balanced
  o.aux_loss_coef = -1;
  EXPECT_THROW(MoE{o}, strata::Error);
}

TEST(MoeLayer, AuxLossesReachTheGateWeight) {
  auto o = options(2, true);
  o.router_z_loss_coef = 0.1;
  MoE m(o);
  Reference ref(m);
  torch::manual_seed(3);
  const auto x = torch::randn({32, kD});
  m->forward(x);
  m->last().l_aux.backward();
  const auto g_laux = m->gate->weight.grad().clone();
  EXPECT_GT(g_laux.abs().sum().item<double>(), 0);
  m->gate->weight.mutable_grad().zero_();
  m->forward(x);
  m->last().z_loss.backward();
  const auto g_z = m->gate->weight.grad().clone();
  // z_loss = coef * mean(logsumexp(x W_g^T)^2), differentiated here by hand's other route.
  auto z_ref = torch::logsumexp(F::linear(x, ref.wg), 1).pow(2).mean() * 0.1;
  z_ref.backward();
  expect_close(g_z, ref.wg.grad(), "d z_loss / d W_g");
  ref.wg.mutable_grad().zero_();
  // l_aux against the gate on the reference's logits (call 0, deterministic top2 apart from the
  // 2nd-expert noise, which the reference replays from the same key).
  auto [unused, g] = ref.forward(o, x, 0);
  g.l_aux.backward();
  expect_close(g_laux, ref.wg.grad(), "d l_aux / d W_g");
  // The experts get no gradient from the aux losses.
  EXPECT_FALSE(m->experts->w1.grad().defined());
}

}  // namespace
