// The host tier's CPU Adam (offload/cpu_adam.h) against LibTorch's own AdamW and Adam (L2) on
// every instruction set this CPU has (STRATA_CPU_ADAM_ISA lowers the choice), split over threads
// or not (the same bits), with 16-bit gradients in and copies out rounded as LibTorch rounds.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "offload/cpu_adam.h"

namespace {

using strata::offload::Float;

strata::optim::AdamScalars scalars(double lr, double wd, bool adam_w, int64_t step) {
  strata::optim::AdamScalars s;
  s.lr = float(lr);
  s.weight_decay = float(wd);
  s.adam_w_mode = adam_w;
  s.one_minus_beta1 = float(1.0 - 0.9), s.one_minus_beta2 = float(1.0 - 0.999);
  s.decay_factor = float(1.0 - lr * wd);
  s.step_size = float(lr / (1.0 - std::pow(0.9, double(step))));
  s.sqrt_c2 = float(std::sqrt(1.0 - std::pow(0.999, double(step))));
  return s;
}

double max_relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max() /
          b.to(torch::kDouble).abs().max())
      .item<double>();
}

std::vector<std::string> isas() {
  std::vector<std::string> out = {"scalar"};
  unsetenv("STRATA_CPU_ADAM_ISA");
  const std::string best = strata::offload::cpu_adam_isa();
  if (best != "scalar") out.push_back("avx2");
  if (best == "avx512") out.push_back("avx512");
  return out;
}

class CpuAdam : public testing::TestWithParam<bool> {};  // AdamW (decoupled) or Adam with L2

TEST_P(CpuAdam, EqualsLibTorchOnEveryInstructionSetAndThreadSplit) {
  const bool adam_w = GetParam();
  const int64_t n = 300007;  // several threads' ranges and an odd tail
  for (const auto& isa : isas()) {
    SCOPED_TRACE(isa);
    setenv("STRATA_CPU_ADAM_ISA", isa.c_str(), 1);
    ASSERT_EQ(std::string(strata::offload::cpu_adam_isa()), isa);
    torch::manual_seed(3);
    auto init = torch::randn({n});
    auto p = init.clone(), m = torch::zeros({n}), v = torch::zeros({n});
    auto p1 = init.clone(), m1 = torch::zeros({n}), v1 = torch::zeros({n});  // one thread
    auto ref = init.clone();
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (adam_w)
      opt = std::make_unique<torch::optim::AdamW>(
          std::vector<torch::Tensor>{ref}, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    else
      opt = std::make_unique<torch::optim::Adam>(
          std::vector<torch::Tensor>{ref}, torch::optim::AdamOptions(1e-3).weight_decay(0.1));
    auto out = torch::empty({n}, torch::kBFloat16), out16 = torch::empty({n}, torch::kHalf);
    for (int64_t step = 1; step <= 5; ++step) {
      auto g = torch::randn({n}) * 2;
      ref.mutable_grad() = g;
      opt->step();
      const auto s = scalars(1e-3, 0.1, adam_w, step);
      strata::offload::cpu_adam_step(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                     g.data_ptr<float>(), Float::kF32, out.data_ptr(),
                                     Float::kBF16, n, s, 3);
      // The gradient in bf16 (what a bf16 model hands over) and an fp16 copy out, one thread.
      auto gb = g.to(torch::kBFloat16);
      strata::offload::cpu_adam_step(p1.data_ptr<float>(), m1.data_ptr<float>(),
                                     v1.data_ptr<float>(), gb.data_ptr(), Float::kBF16,
                                     out16.data_ptr(), Float::kF16, n, s, 1);
      EXPECT_TRUE(torch::equal(out, p.to(torch::kBFloat16))) << "bf16 copy-out, step " << step;
      EXPECT_TRUE(torch::equal(out16, p1.to(torch::kHalf))) << "fp16 copy-out, step " << step;
    }
    EXPECT_LT(max_relative(p, ref), 1e-6);
    // A bf16 gradient is the fp32 one rounded: close, not equal.
    EXPECT_LT(max_relative(p1, ref), 1e-3);
  }
  unsetenv("STRATA_CPU_ADAM_ISA");
}

INSTANTIATE_TEST_SUITE_P(Modes, CpuAdam, testing::Values(true, false));

TEST(CpuAdam, ThreadSplitsGiveTheSameBits) {
  const int64_t n = 1 << 20;
  torch::manual_seed(4);
  auto g = torch::randn({n});
  std::vector<torch::Tensor> results;
  for (int threads : {1, 2, 5}) {
    auto p = torch::ones({n}), m = torch::zeros({n}), v = torch::zeros({n});
    strata::offload::cpu_adam_step(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                   g.data_ptr<float>(), Float::kF32, nullptr, Float::kF32, n,
                                   scalars(1e-2, 0.0, true, 1), threads);
    results.push_back(p);
  }
  EXPECT_TRUE(torch::equal(results[0], results[1]));
  EXPECT_TRUE(torch::equal(results[0], results[2]));
}

// The gradient norm's pass: fp32, bf16 and fp16 against LibTorch's sum in double, on 1 and 3
// threads, with a length that leaves remainders everywhere.
TEST(CpuSumSquares, EqualsLibTorchForEachDtypeAndThreadCount) {
  torch::manual_seed(3);
  const int64_t n = 1000003;
  const auto base = torch::randn({n}) * 3;
  const std::pair<torch::ScalarType, strata::offload::Float> types[] = {
      {torch::kFloat, strata::offload::Float::kF32},
      {torch::kBFloat16, strata::offload::Float::kBF16},
      {torch::kHalf, strata::offload::Float::kF16}};
  for (const auto& [dtype, type] : types) {
    const auto g = base.to(dtype);
    const double want = g.to(torch::kDouble).pow(2).sum().item<double>();
    for (int threads : {1, 3}) {
      const double got = strata::offload::cpu_sum_squares(g.data_ptr(), type, n, threads);
      EXPECT_NEAR(got, want, want * 1e-6) << c10::toString(dtype) << ", " << threads << " threads";
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float with_inf[] = {1.f, inf, 2.f};
  EXPECT_FALSE(std::isfinite(strata::offload::cpu_sum_squares(with_inf, strata::offload::Float::kF32, 3, 1)));
}

}  // namespace
