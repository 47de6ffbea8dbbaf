// The example GPT's fused head and cross-entropy (examples/linear_cross_entropy.h) against
// LibTorch's own linear + cross_entropy: the loss, both gradients (chunks that do not divide the
// rows, an upstream gradient that is not 1), bf16, and its memory at malloc.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "examples/gpt.h"
#include "examples/linear_cross_entropy.h"
#include "tests/alloc_meter.h"

namespace {

namespace F = torch::nn::functional;
using strata::examples::linear_cross_entropy_sum;

TEST(LinearCrossEntropy, EqualsLinearThenCrossEntropyWithItsGradients) {
  torch::manual_seed(5);
  const int64_t rows = 37, d = 6, vocab = 11;
  const auto opts = torch::dtype(torch::kDouble).requires_grad(true);
  const auto h = torch::randn({rows, d}, opts), w = torch::randn({vocab, d}, opts);
  const auto t = torch::randint(0, vocab, {rows}, torch::kLong);
  const auto got = linear_cross_entropy_sum(h, w, t, /*chunk_rows=*/8) * 0.3;
  const auto want = F::cross_entropy(F::linear(h, w).to(torch::kFloat), t,
                                     F::CrossEntropyFuncOptions().reduction(torch::kSum)) * 0.3;
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-4);
  const auto g = torch::autograd::grad({got}, {h, w});
  const auto r = torch::autograd::grad({want}, {h, w});
  EXPECT_TRUE(torch::allclose(g[0], r[0], 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(g[1], r[1], 1e-5, 1e-6));
  EXPECT_EQ(g[1].scalar_type(), torch::kDouble);  // W's gradient in W's dtype
}

TEST(LinearCrossEntropy, Bf16FollowsFloat) {
  torch::manual_seed(6);
  const auto h = torch::randn({64, 16}), w = torch::randn({50, 16}) * 0.3;
  const auto t = torch::randint(0, 50, {64}, torch::kLong);
  const auto hb = h.to(torch::kBFloat16).requires_grad_(true);
  const auto wb = w.to(torch::kBFloat16).requires_grad_(true);
  const auto hf = hb.detach().to(torch::kFloat).requires_grad_(true);
  const auto wf = wb.detach().to(torch::kFloat).requires_grad_(true);
  const auto lb = linear_cross_entropy_sum(hb, wb, t, 16), lf = linear_cross_entropy_sum(hf, wf, t, 16);
  EXPECT_NEAR(lb.item<double>() / 64, lf.item<double>() / 64, 2e-2);
  lb.backward();
  lf.backward();
  EXPECT_EQ(wb.grad().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(hb.grad().to(torch::kFloat), hf.grad(), 5e-2, 5e-2));
  EXPECT_TRUE(torch::allclose(wb.grad().to(torch::kFloat), wf.grad(), 5e-2, 5e-2));
}

// The logits never exist whole: forward + backward peak well under the float32 logits alone.
TEST(LinearCrossEntropy, HoldsAChunkOfLogitsNotAllOfThem) {
  using strata::test::AllocMeter;
  if (!AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  const int64_t rows = 4096, d = 32, vocab = 4000, chunk = 64;
  const auto h = torch::randn({rows, d}).requires_grad_(true);
  const auto w = torch::randn({vocab, d}).requires_grad_(true);
  const auto t = torch::randint(0, vocab, {rows}, torch::kLong);
  linear_cross_entropy_sum(h, w, t, chunk).backward();  // first-call state out of the measure
  h.mutable_grad() = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  AllocMeter::reset_peak();
  linear_cross_entropy_sum(h, w, t, chunk).backward();
  const int64_t peak = AllocMeter::peak_since_reset();
  const int64_t logits = rows * vocab * 4;  // float32 [rows, vocab]: 65.5 MB
  // A chunk's logits, their float32 copy and gradient, W's float32 gradient (twice: the sum and
  // its scaled copy), h's gradient.
  const int64_t bound = 4 * chunk * vocab * 4 + 2 * vocab * d * 4 + 2 * rows * d * 4;
  EXPECT_LE(peak, bound) << "peak " << peak << " bytes; the logits alone are " << logits;
  EXPECT_LT(bound, logits / 4);
}

TEST(LinearCrossEntropy, WithoutGradModeComputesTheLossAlone) {
  const auto h = torch::randn({8, 4}), w = torch::randn({5, 4}).requires_grad_(true);
  const auto t = torch::randint(0, 5, {8}, torch::kLong);
  torch::NoGradGuard no_grad;
  const auto l = linear_cross_entropy_sum(h, w, t, 3);
  EXPECT_FALSE(l.requires_grad());
  EXPECT_NEAR(l.item<double>(),
              F::cross_entropy(F::linear(h, w), t, F::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>(),
              1e-4);
}

TEST(LinearCrossEntropy, RefusesMismatchedShapes) {
  EXPECT_THROW(linear_cross_entropy_sum(torch::zeros({4, 3}), torch::zeros({5, 2}),
                                        torch::zeros({4}, torch::kLong), 2),
               std::invalid_argument);
}

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
