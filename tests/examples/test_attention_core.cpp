// The example GPT's attention core: its split of q, k, v out of the projection against the plain
// views. (The fused head + loss it uses is the library's: tests/runtime/nn.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "examples/gpt.h"

namespace {

// The attention's core splits q, k, v out of the projection with its own backward (one packed
// gradient): the values and gradients of the plain view / permute / unbind formulation.
TEST(AttentionCore, SplitHeadsGivesTheGradientsOfThePlainViews) {
  torch::manual_seed(8);
  const int64_t b = 2, t = 5, heads = 2, d = 8;
  strata::examples::Attention attention(d, heads);
  const auto p = torch::randn({b, t, 3 * d}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto probe = torch::randn({b, t, d}, torch::kDouble);
  const auto got = attention->core(p);
  const auto qkv = p.view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
  const auto want = strata::examples::causal_attention(qkv[0], qkv[1], qkv[2], 0.0)
                        .transpose(1, 2)
                        .reshape({b, t, d});
  EXPECT_TRUE(torch::allclose(got, want, 1e-12, 1e-12));
  const auto g = torch::autograd::grad({(got * probe).sum()}, {p})[0];
  const auto r = torch::autograd::grad({(want * probe).sum()}, {p})[0];
  EXPECT_TRUE(g.is_contiguous());
  EXPECT_TRUE(torch::allclose(g, r, 1e-12, 1e-12));
}

}  // namespace
