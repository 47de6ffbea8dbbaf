// strata::optim::Adam::step_flat (the fused flat step: a CUDA kernel on GPUs, a parallel loop on
// CPUs) against the per-tensor reference step() on the same device: every gradient and copy-out
// dtype, AdamW and L2 modes, with and without bias correction, a gradient scale. Built twice:
// test_fused_adam (CPU, label unit) and test_fused_adam_gpu (CUDA, label gpu; skips without one).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "runtime/error.h"
#include "runtime/optim/adam.h"

namespace {

using strata::optim::Adam;
using strata::optim::AdamOptions;

// One name per binary: CTest keys test properties (labels) by name.
#if STRATA_TEST_CUDA
#define FUSED_ADAM_SUITE FusedAdamGpu
#else
#define FUSED_ADAM_SUITE FusedAdam
#endif

torch::Device test_device() {
#if STRATA_TEST_CUDA
  return torch::Device(torch::kCUDA, 0);
#else
  return torch::kCPU;
#endif
}

#define REQUIRE_DEVICE()                                                              \
  do {                                                                                \
    if (test_device().is_cuda() && !torch::cuda::is_available())                      \
      GTEST_SKIP() << "no CUDA device (or this LibTorch has no CUDA)";                \
  } while (0)

// Largest difference relative to the tensor's scale (elementwise relative error is meaningless
// for moments that cancel to near zero).
double max_relative(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kDouble).cpu(), y = b.to(torch::kDouble).cpu();
  return (x - y).abs().max().item<double>() / y.abs().max().item<double>();
}

struct Case {
  torch::ScalarType grad_dtype, out_dtype;
  bool adam_w_mode, bias_correction;
  double weight_decay, grad_scale;
  bool copy_out;
};

void compare(const Case& c) {
  const auto dev = test_device();
  torch::manual_seed(1);
  const int64_t n = 100003;  // odd: the kernel's tail and unaligned rest
  auto options = torch::TensorOptions().dtype(torch::kFloat).device(dev);
  auto init = torch::randn({n}, options);
  auto fused_p = init.clone(), ref_p = init.clone();
  AdamOptions o(2e-3);
  // beta2 = 0.999: 1 - beta2 is inexact in float (the scalars carry it from double).
  o.betas(std::make_tuple(0.9, 0.999)).eps(1e-8).weight_decay(c.weight_decay);
  o.adam_w_mode(c.adam_w_mode).bias_correction(c.bias_correction);
  Adam fused({fused_p}, o), ref({ref_p}, o);
  ASSERT_TRUE(fused.can_step_flat());
  auto out = c.copy_out ? torch::empty({n}, options.dtype(c.out_dtype)) : torch::Tensor();
  for (int step = 0; step < 6; ++step) {
    // Gradients as the model's dtype holds them; the reference sees the same values, scaled.
    auto grad = (torch::randn({n}, options) * 3).to(c.grad_dtype);
    ref_p.mutable_grad() = grad.to(torch::kFloat) * c.grad_scale;
    ref.step();
    fused.step_flat(grad, c.grad_scale, out);
  }
  const double tol = dev.is_cuda() ? 2e-6 : 1e-6;  // nvcc may contract a*b+c into one rounding
  EXPECT_LT(max_relative(fused_p, ref_p), tol);
  auto& fs = static_cast<strata::optim::AdamParamState&>(
      *fused.state().begin()->second);
  auto& rs = static_cast<strata::optim::AdamParamState&>(*ref.state().begin()->second);
  EXPECT_EQ(fs.step(), 6);
  EXPECT_LT(max_relative(fs.exp_avg(), rs.exp_avg()), tol);
  EXPECT_LT(max_relative(fs.exp_avg_sq(), rs.exp_avg_sq()), tol);
  // The copy-out is the updated master rounded to its dtype, bit for bit.
  if (c.copy_out) EXPECT_TRUE(torch::equal(out.cpu(), fused_p.to(c.out_dtype).cpu()));
}

TEST(FUSED_ADAM_SUITE, AdamWBf16GradientWithBf16CopyOut) {
  REQUIRE_DEVICE();
  compare({torch::kBFloat16, torch::kBFloat16, true, true, 0.1, 1.0, true});
}

TEST(FUSED_ADAM_SUITE, AdamWFp16GradientScaledWithFp16CopyOut) {
  REQUIRE_DEVICE();
  compare({torch::kHalf, torch::kHalf, true, true, 0.01, 1.0 / 1024, true});
}

TEST(FUSED_ADAM_SUITE, L2ModeFp32GradientWithFp32CopyOut) {
  REQUIRE_DEVICE();
  compare({torch::kFloat, torch::kFloat, false, true, 0.05, 0.5, true});
}

TEST(FUSED_ADAM_SUITE, WithoutBiasCorrectionOrCopyOut) {
  REQUIRE_DEVICE();
  compare({torch::kBFloat16, torch::kBFloat16, true, false, 0.0, 0.25, false});
}

TEST(FUSED_ADAM_SUITE, RejectsWhatItCannotStep) {
  REQUIRE_DEVICE();
  const auto dev = test_device();
  auto p = torch::zeros({8}, torch::TensorOptions().device(dev));
  Adam adam({p}, AdamOptions(1e-3));
  EXPECT_THROW(adam.step_flat(torch::zeros({7}, p.options()), 1.0, {}), strata::Error);
  EXPECT_THROW(adam.step_flat(torch::zeros({8}, p.options().dtype(torch::kLong)), 1.0, {}),
               strata::Error);
  EXPECT_THROW(adam.step_flat(torch::zeros({8}, p.options()), 1.0, p), strata::Error);
  Adam two({torch::zeros({4}, p.options()), torch::zeros({4}, p.options())}, AdamOptions(1e-3));
  EXPECT_FALSE(two.can_step_flat());
  EXPECT_THROW(two.step_flat(torch::zeros({4}, p.options()), 1.0, {}), strata::Error);
}

}  // namespace
