// runtime/nn's rotary embedding and SwiGLU against Hugging Face's formulas written op by op, on the
// CPU (the composite path): the same values and autograd's gradients bit for bit, in fp32 and bf16,
// for the layouts the models pass (a transposed projection, a window of the position tables); what
// SwiGLU keeps for backward, measured at malloc; the shape errors. The CUDA kernels are held to the
// same formulas in test_fused_layers_gpu.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

#include "runtime/nn/rotary.h"
#include "runtime/nn/swiglu.h"
#include "tests/alloc_meter.h"

namespace strata::test::fused_layers {  // named: a unity build joins the suite's files
namespace {

namespace F = torch::nn::functional;

// transformers' rotate_half form.
torch::Tensor rotary_op_by_op(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin) {
  const auto half = x.size(-1) / 2;
  const auto rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

std::pair<torch::Tensor, torch::Tensor> tables(int64_t seq, int64_t dim, torch::ScalarType t) {
  const auto inv = 1.0 / torch::pow(10000.0, torch::arange(0, dim, 2).to(torch::kFloat) / double(dim));
  const auto freqs = torch::outer(torch::arange(seq).to(torch::kFloat), inv);
  const auto angles = torch::cat({freqs, freqs}, -1);
  return {angles.cos().to(t), angles.sin().to(t)};
}

// The value and x's gradient under a probe, of f(x).
template <class Fn>
std::pair<torch::Tensor, torch::Tensor> value_and_grad(Fn&& f, const torch::Tensor& x0,
                                                       const torch::Tensor& probe) {
  auto x = x0.detach().clone().requires_grad_(true);
  auto y = f(x);
  (y.to(torch::kFloat) * probe).sum().backward();
  return {y.detach(), x.grad()};
}

TEST(Rotary, IsHuggingFacesRotateHalfWithItsGradientBitForBit) {
  torch::manual_seed(7);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // q as the model has it: a [b, t, h, d] projection viewed as [b, h, t, d]; the tables a window
    // of longer ones (Ulysses' shard of positions).
    const auto x = torch::randn({2, 5, 3, 16}).to(dtype).transpose(1, 2);
    auto [cos_all, sin_all] = tables(12, 16, dtype);
    const auto cos = cos_all.narrow(0, 4, 5), sin = sin_all.narrow(0, 4, 5);
    const auto probe = torch::randn({2, 3, 5, 16});
    const auto got = value_and_grad([&](const torch::Tensor& a) { return nn::rotary(a, cos, sin); }, x, probe);
    const auto want = value_and_grad([&](const torch::Tensor& a) { return rotary_op_by_op(a, cos, sin); }, x, probe);
    EXPECT_EQ(got.first.scalar_type(), dtype);
    EXPECT_TRUE(got.first.equal(want.first));
    EXPECT_TRUE(got.second.equal(want.second));
  }
}

TEST(Rotary, RefusesTablesThatDoNotFit) {
  const auto x = torch::zeros({1, 2, 4, 8});
  EXPECT_THROW(nn::rotary(x, torch::zeros({4, 6}), torch::zeros({4, 6})), std::invalid_argument);
  EXPECT_THROW(nn::rotary(x, torch::zeros({4, 8}), torch::zeros({4, 4})), std::invalid_argument);
  EXPECT_THROW(nn::rotary(torch::zeros({1, 2, 4, 7}), torch::zeros({4, 7}), torch::zeros({4, 7})),
               std::invalid_argument);
}

TEST(SwiGlu, IsSiluTimesUpWithAutogradsGradientsBitForBit) {
  torch::manual_seed(8);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto gate = (torch::randn({3, 7, 40}) * 4).to(dtype).requires_grad_(true);
    auto up = torch::randn({3, 7, 40}).to(dtype).requires_grad_(true);
    auto gate2 = gate.detach().clone().requires_grad_(true);
    auto up2 = up.detach().clone().requires_grad_(true);
    const auto probe = torch::randn({3, 7, 40});
    const auto got = nn::swiglu(gate, up);
    const auto want = F::silu(gate2) * up2;
    (got.to(torch::kFloat) * probe).sum().backward();
    (want.to(torch::kFloat) * probe).sum().backward();
    EXPECT_EQ(got.scalar_type(), dtype);
    EXPECT_TRUE(got.equal(want));
    EXPECT_TRUE(gate.grad().equal(gate2.grad()));
    EXPECT_TRUE(up.grad().equal(up2.grad()));
  }
  EXPECT_THROW(nn::swiglu(torch::zeros({2, 3}), torch::zeros({3, 2})), std::invalid_argument);
}

// The packed form: gate and up the halves of one projection's output.
TEST(SwiGlu, OfThePackedHalvesIsTheSameWithOneGradient) {
  torch::manual_seed(9);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto h = (torch::randn({5, 2, 48}) * 3).to(dtype).requires_grad_(true);
    auto h2 = h.detach().clone().requires_grad_(true);
    const auto probe = torch::randn({5, 2, 24});
    const auto got = nn::swiglu(h);
    const auto want = F::silu(h2.narrow(-1, 0, 24)) * h2.narrow(-1, 24, 24);
    (got.to(torch::kFloat) * probe).sum().backward();
    (want.to(torch::kFloat) * probe).sum().backward();
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_TRUE(got.equal(want));
    EXPECT_TRUE(h.grad().equal(h2.grad()));
  }
  EXPECT_THROW(nn::swiglu(torch::zeros({2, 5})), std::invalid_argument);
}

// One node keeps gate and up (alive anyway: the projections' outputs); autograd's graph of the
// composite keeps silu(gate) besides.
TEST(SwiGlu, KeepsNothingBeyondItsInputsForBackward) {
  if (!AllocMeter::active()) GTEST_SKIP() << "no allocation meter in this build";
  const int64_t rows = 2048, ffn = 512;
  const auto gate = torch::randn({rows, ffn}).to(torch::kBFloat16).requires_grad_(true);
  const auto up = torch::randn({rows, ffn}).to(torch::kBFloat16).requires_grad_(true);
  auto kept = [&](auto&& f) {
    const int64_t before = AllocMeter::live();
    auto y = f();
    const int64_t held = AllocMeter::live() - before - y.numel() * y.element_size();
    y.sum().backward();
    return held;
  };
  const int64_t fused = kept([&] { return nn::swiglu(gate, up); });
  const int64_t plain = kept([&] { return F::silu(gate) * up; });
  std::printf("MESSAGE: SwiGLU over %lld x %lld bf16: kept for backward %lld bytes (one node) "
              "against %lld (op by op)\n",
              (long long)rows, (long long)ffn, (long long)fused, (long long)plain);
  EXPECT_LE(fused, rows * ffn * 2 / 64);  // the node's bookkeeping, not a tensor (1/64 of one)
  EXPECT_GE(plain, rows * ffn * 2);  // silu(gate) in bf16
}

}  // namespace
}  // namespace strata::test::fused_layers
