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

// The cut itself, for every (n, threads) up to a few cache lines past the thresholds: the ranges
// cover [0, n) exactly and in order, at most `threads` of them, each but the last on a cache line.
// (The cut was floor(n / threads) rounded up to 64, which left the last n % threads elements out
// whenever floor(n / threads) was a multiple of 64.)
TEST(CpuAdamThreadSplit, CoversEveryElementOnceForEveryLengthAndThreadCount) {
  for (const int64_t min_per_thread : {int64_t(1), int64_t(64), int64_t(100)}) {
    for (int threads = 1; threads <= 9; ++threads) {
      for (int64_t n = 0; n <= 64 * 9 * 4 + 70; ++n) {
        const auto ranges = strata::offload::split_for_threads(n, threads, min_per_thread);
        int64_t next = 0;
        for (size_t i = 0; i < ranges.size(); ++i) {
          ASSERT_EQ(ranges[i].begin, next) << "n " << n << ", threads " << threads;
          ASSERT_LT(ranges[i].begin, ranges[i].end) << "n " << n << ", threads " << threads;
          if (i + 1 < ranges.size()) {
            ASSERT_EQ((ranges[i].end - ranges[i].begin) % 64, 0) << "n " << n << ", threads " << threads;
          }
          next = ranges[i].end;
        }
        ASSERT_EQ(next, n) << "n " << n << ", threads " << threads << ", min " << min_per_thread;
        ASSERT_LE(ranges.size(), size_t(threads)) << "n " << n;
      }
    }
  }
}

// The step and the norm on lengths that the old cut got wrong (131073 on 2 threads: the issue's
// last parameter never stepped) and on neighbours, against the scalar loop of adam_math.h and a
// sum in double. The copy-out starts as NaN, so an element the step skips shows.
TEST(CpuAdamThreadSplit, StepAndNormMatchTheScalarLoopOnEveryCut) {
  const int64_t k = int64_t(1) << 16;  // the step's min_per_thread
  const auto s = scalars(1e-2, 0.1, true, 1);
  for (const auto& isa : isas()) {
    setenv("STRATA_CPU_ADAM_ISA", isa.c_str(), 1);
    for (const auto& [n, threads] : std::vector<std::pair<int64_t, int>>{
             {2 * k + 1, 2}, {3 * k + 2, 3}, {5 * 65600 + 4, 5}, {4 * k + 3, 4}, {2 * k + 63, 2},
             {2 * k - 1, 2}, {7 * k + 6, 7}, {4 * k + 1, 3}}) {
      SCOPED_TRACE(isa + ", n " + std::to_string(n) + ", threads " + std::to_string(threads));
      torch::manual_seed(n);
      const auto g = torch::randn({n});
      auto p = torch::randn({n}), m = torch::zeros({n}), v = torch::zeros({n});
      auto rp = p.clone(), rm = m.clone(), rv = v.clone();
      auto out = torch::full({n}, std::numeric_limits<float>::quiet_NaN());
      strata::offload::cpu_adam_step(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                     g.data_ptr<float>(), Float::kF32, out.data_ptr(), Float::kF32,
                                     n, s, threads);
      float *pp = rp.data_ptr<float>(), *pm = rm.data_ptr<float>(), *pv = rv.data_ptr<float>();
      const float* pg = g.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) strata::optim::adam_update(pp[i], pm[i], pv[i], pg[i], s);
      EXPECT_TRUE(torch::equal(out, p)) << "the copy-out is not the new weights everywhere";
      if (isa == "scalar") {
        EXPECT_TRUE(torch::equal(p, rp));
        EXPECT_TRUE(torch::equal(m, rm));
        EXPECT_TRUE(torch::equal(v, rv));
      } else {  // fused multiply-adds round in the last bit
        EXPECT_LT(max_relative(p, rp), 1e-6);
        EXPECT_LT(max_relative(v, rv), 1e-5);
      }
      // The norm's pass cuts the same way (its threshold is 2^18 elements): four times the
      // per-thread share, the same remainder.
      const auto big = torch::randn({4 * threads * (n / threads) + n % threads});
      const double want = big.to(torch::kDouble).pow(2).sum().item<double>();
      const double got = strata::offload::cpu_sum_squares(big.data_ptr(), Float::kF32, big.numel(), threads);
      EXPECT_NEAR(got, want, want * 1e-6);
    }
  }
  unsetenv("STRATA_CPU_ADAM_ISA");
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
