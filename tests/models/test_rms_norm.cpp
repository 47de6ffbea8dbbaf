// models::RMSNorm as one autograd node: the same values and gradients as Hugging Face's formula
// written op by op (fp32 within 1e-6; bf16 within its rounding), under the weight's own dtype and
// under mixed dtypes (autocast's fp32 weight on bf16 rows); and what it keeps for backward,
// measured at malloc: x (already alive) and one fp32 number per row, where the op-by-op graph
// keeps the fp32 copy of x and the normed rows (6 bytes per element in bf16).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/causal_lm.h"
#include "tests/alloc_meter.h"

namespace strata::test::rms_norm {  // named: a unity build joins it with test_hf_config.cpp
namespace {

torch::Tensor op_by_op(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto xf = x.to(torch::kFloat);
  const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

struct Grads {
  torch::Tensor y, dx, dw;
};

template <class F>
Grads run(F&& f, const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& probe) {
  auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  auto y = f(x, w);
  (y.to(torch::kFloat) * probe).sum().backward();
  return {y.detach(), x.grad(), w.grad()};
}

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max() /
          b.to(torch::kDouble).abs().max().clamp_min(1e-30))
      .item<double>();
}

TEST(RmsNorm, ValuesAndGradientsAreHuggingFacesFormula) {
  torch::manual_seed(5);
  for (const auto& [xt, wt, tol] : {std::tuple{torch::kFloat, torch::kFloat, 1e-6},
                                    std::tuple{torch::kBFloat16, torch::kBFloat16, 2e-2},
                                    std::tuple{torch::kBFloat16, torch::kFloat, 2e-2}}) {
    SCOPED_TRACE(std::string(c10::toString(xt)) + " rows, " + c10::toString(wt) + " weight");
    models::RMSNorm norm(64, 1e-5);
    const auto x = (torch::randn({3, 7, 64}) * 3).to(xt);
    const auto w = (1 + 0.1 * torch::randn({64})).to(wt);
    const auto probe = torch::randn({3, 7, 64});
    const auto got = run([&](const torch::Tensor& a, const torch::Tensor& b) {
      norm->weight = b;
      return norm->forward(a);
    }, x, w, probe);
    const auto want = run([](const torch::Tensor& a, const torch::Tensor& b) {
      return op_by_op(a, b, 1e-5);
    }, x, w, probe);
    EXPECT_EQ(got.y.scalar_type(), want.y.scalar_type());
    EXPECT_EQ(got.dx.scalar_type(), want.dx.scalar_type());
    EXPECT_EQ(got.dw.scalar_type(), want.dw.scalar_type());
    EXPECT_TRUE(got.y.equal(want.y));  // the forward is the same ops
    EXPECT_LE(rel(got.dx, want.dx), tol);
    EXPECT_LE(rel(got.dw, want.dw), tol);
  }
}

TEST(RmsNorm, KeepsOneFloatPerRowForBackward) {
  if (!AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  const int64_t rows = 4096, d = 256;
  models::RMSNorm norm(d, 1e-6);
  norm->weight = norm->weight.to(torch::kBFloat16);
  const auto x = torch::randn({rows, d}).to(torch::kBFloat16).requires_grad_(true);
  auto kept = [&](auto&& f) {
    const int64_t before = AllocMeter::live();
    auto y = f();
    const int64_t held = AllocMeter::live() - before - y.numel() * y.element_size();
    y.sum().backward();  // the graph goes with it
    return held;
  };
  const int64_t fused = kept([&] { return norm->forward(x); });
  const int64_t plain = kept([&] { return op_by_op(x, norm->weight, 1e-6); });
  std::printf("MESSAGE: RMSNorm over %lld x %lld bf16: kept for backward %lld bytes (one node) "
              "against %lld (op by op)\n",
              (long long)rows, (long long)d, (long long)fused, (long long)plain);
  EXPECT_LE(fused, rows * 4 + 8192);          // the fp32 reciprocal norms, and the node's bookkeeping
  EXPECT_GE(plain, rows * d * (4 + 2));       // x in fp32 and the normed rows in bf16
}

}  // namespace
}  // namespace strata::test::rms_norm
