// The MoE layer on a CUDA device: how often forward + backward makes the host wait for the
// device. LibTorch's sync debug mode reports every synchronising CUDA call (item, nonzero, a
// blocking copy, ...) as a warning; a handler counts them. The budget (moe/layer.h): none with
// drop_tokens = true (k = 1 with RTS, Jitter or RSample; k = 2 with 2nd-expert sampling; k = 4),
// at most one with drop_tokens = false (the capacity), none at ep_size 1 with the grouped
// kernel (no capacity). float32 and bf16 (where the built-in
// experts take at::_grouped_mm on sm90); the grouped kernel is also checked against the batched
// one. Skips without CUDA.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <string>

#include "moe/dispatch.h"
#include "moe/layer.h"
#include "runtime/compat.h"
#include "tests/cuda_sync_counter.h"

#if STRATA_TEST_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#endif

namespace {

using namespace strata::moe;

#if STRATA_TEST_HAS_CUDA
constexpr int64_t kD = 64, kFfn = 128, kE = 8, kS = 256;

using strata::test_support::count_syncs;

struct Case {
  const char* name;
  int64_t k;
  bool drop_tokens;
  NoisyGatePolicy noise = NoisyGatePolicy::None;
  bool use_rts = true;
  bool second_sampling = true;
  torch::Dtype dtype = torch::kFloat;
};

MoEOptions options(const Case& cs) {
  MoEOptions o;
  o.hidden_size = kD;
  o.ffn_size = kFfn;
  o.num_experts = kE;
  o.k = cs.k;
  o.capacity_factor = 1.0;  // drops with drop_tokens
  o.min_capacity = 0;
  o.drop_tokens = cs.drop_tokens;
  o.use_rts = cs.use_rts;
  o.noisy_gate_policy = cs.noise;
  o.top2_2nd_expert_sampling = cs.second_sampling;
  o.router_z_loss_coef = 0.01;
  o.aux_loss_coef = 0.1;
  o.seed = 3;
  return o;
}

// Host syncs of one training forward + backward (after a warm-up step).
int syncs_per_step(const Case& cs) {
  const torch::Device dev(torch::kCUDA, 0);
  MoE m(options(cs));
  m->to(dev, cs.dtype);
  torch::manual_seed(0);
  const auto x = torch::randn({kS, kD}, torch::TensorOptions().device(dev).dtype(cs.dtype))
                     .requires_grad_(true);
  const auto probe = torch::randn_like(x);
  auto step = [&] {
    auto y = m->forward(x);
    ((y * probe).sum().to(torch::kFloat) + m->loss()).backward();
  };
  step();  // warm: the allocators (device and page-locked host)
  const int syncs = count_syncs(step);
  if (cs.drop_tokens) {
    EXPECT_GT(m->last().dropped_count(), 0) << cs.name << ": the case should drop routes";
  }
  EXPECT_TRUE(m->experts->w1.grad().defined()) << cs.name;
  return syncs;
}
#endif

TEST(MoeLayerGpu, SyncCounterSeesAnItemCall) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto t = torch::ones({4}, torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(count_syncs([&] { (void)t.sum().item<float>(); }), 1);
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

TEST(MoeLayerGpu, HostSyncsWithinBudget) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const Case cases[] = {
      {"k1_rts", 1, true},
      {"k1_rts_jitter", 1, true, NoisyGatePolicy::Jitter},
      {"k1_rsample", 1, true, NoisyGatePolicy::RSample},
      {"k2_sampling", 2, true},
      {"k2_sampling_bf16", 2, true, NoisyGatePolicy::None, true, true, torch::kBFloat16},
      {"k4", 4, true},
      {"k1_no_drop", 1, false},
      {"k2_no_drop", 2, false},
  };
  for (const auto& cs : cases) {
    const int syncs = syncs_per_step(cs);
    std::cout << "[ INFO     ] " << cs.name << ": " << syncs << " host syncs per forward+backward\n";
    EXPECT_LE(syncs, cs.drop_tokens ? 0 : 1) << cs.name;
  }
  // Dropless at ep_size 1 with the grouped kernel (bf16 on Hopper): no capacity is read, none.
  const Case packed[] = {
      {"k2_no_drop_bf16_grouped", 2, false, NoisyGatePolicy::None, true, true, torch::kBFloat16}};
  for (const auto& cs : packed) {
    const int syncs = syncs_per_step(cs);
    std::cout << "[ INFO     ] " << cs.name << ": " << syncs << " host syncs per forward+backward\n";
    MoE probe(options(cs));
    probe->to(torch::Device(torch::kCUDA, 0), cs.dtype);
    const auto x = torch::randn({kS, kD}, torch::TensorOptions().device(torch::kCUDA).dtype(cs.dtype));
    if (probe->experts->grouped(x)) EXPECT_EQ(syncs, 0) << cs.name;
  }
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

// The grouped kernel (filled rows only; at::_grouped_mm where available) against the batched one
// on the same layer and call, bf16: outputs and gradients agree to bf16 precision.
TEST(MoeLayerGpu, GroupedKernelMatchesBatched) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device dev(torch::kCUDA, 0);
  // With capacity, and dropless (the grouped kernel's routes then a permutation: the gathers and
  // bag sums of moe/dispatch.h, on the GPU).
  for (const bool drop : {true, false}) {
  Case cs{drop ? "k2_bf16" : "k2_bf16_dropless", 2, drop, NoisyGatePolicy::None, true, true,
          torch::kBFloat16};
  for (const bool bias : {true, false}) {  // DeepSpeed's experts and moe-8x's (no biases)
  auto o = options(cs);
  o.expert_bias = bias;
  MoE m(o);
  m->to(dev, torch::kBFloat16);
  const auto bf16 = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
  const auto probe_in = torch::zeros({kE, 1, kD}, bf16);
#if STRATA_TORCH_AT_LEAST(2, 9)
  const int major = at::cuda::getCurrentDeviceProperties()->major;
  if (major == 9) EXPECT_TRUE(m->experts->grouped(probe_in)) << "sm90 bf16 should take _grouped_mm";
#endif
  std::cout << "[ INFO     ] bias " << bias << ", grouped kernel by default: "
            << m->experts->grouped(probe_in) << "\n";
  torch::manual_seed(1);
  const auto x0 = torch::randn({kS, kD}, bf16);
  const auto probe = torch::randn_like(x0);
  auto run = [&](ExpertKernel kernel) {
    m->experts->set_kernel(kernel);
    m->set_call_index(4);
    m->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    auto y = m->forward(x);
    (y.to(torch::kFloat) * probe.to(torch::kFloat)).sum().backward();
    std::vector<torch::Tensor> out{y.detach().to(torch::kFloat), x.grad().to(torch::kFloat),
                                   m->experts->w1.grad().to(torch::kFloat),
                                   m->experts->w2.grad().to(torch::kFloat)};
    if (bias) {
      out.push_back(m->experts->b1.grad().to(torch::kFloat));
      out.push_back(m->experts->b2.grad().to(torch::kFloat));
    }
    return out;
  };
  const auto batched = run(ExpertKernel::Batched);
  const auto grouped = run(ExpertKernel::Grouped);
  const char* names[] = {"output", "d input", "d w1", "d w2", "d b1", "d b2"};
  for (size_t i = 0; i < batched.size(); ++i) {
    const double scale = batched[i].abs().max().item<double>();
    const double diff = (grouped[i] - batched[i]).abs().max().item<double>();
    EXPECT_GT(scale, 0) << names[i] << ", bias " << bias << ", " << cs.name;
    EXPECT_LE(diff, 3e-2 * scale) << names[i] << ", bias " << bias << ", " << cs.name;
  }
  }
  }
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

// Streamed experts (expert_unit_size 2) on the device's grouped kernel, ep_size 1 (the packed
// routes): the same outputs and gradients as the stacked layer to bf16 precision, and one host
// sync per forward (the routed rows per expert), none in backward.
// The bag sums' two kernels (moe/dispatch.h) on the GPU: embedding_bag's and the gather with a
// batched product that RoutePermutation takes there.
TEST(MoeLayerGpu, BagSumKernelsAgree) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device dev(torch::kCUDA, 0);
  torch::manual_seed(2);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto table = torch::randn({300, 96}).to(dev, dtype);
    for (const int64_t bag : {1, 6}) {
      const auto index = torch::randint(300, {128 * bag}, torch::kLong).to(dev);
      for (const bool weighted : {false, true}) {
        const auto weight = weighted ? torch::rand({128 * bag}).to(dev, dtype) : torch::Tensor();
        const auto want = strata::moe::detail::bag_sums_embedding_bag(table, index, bag, weight).to(torch::kDouble);
        const auto got = strata::moe::detail::bag_sums_gathered(table, index, bag, weight).to(torch::kDouble);
        const double tol = dtype == torch::kBFloat16 ? 1e-2 : 1e-5;
        EXPECT_TRUE(torch::allclose(got, want, tol, tol))
            << c10::toString(dtype) << " bag " << bag << " weighted " << weighted
            << ": max diff " << (got - want).abs().max().item<double>();
      }
    }
  }
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

TEST(MoeLayerGpu, StreamedExpertsMatchStackedWithOneSyncPerForward) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device dev(torch::kCUDA, 0);
  Case cs{"k2_bf16", 2, false, NoisyGatePolicy::None, true, true, torch::kBFloat16};
  auto o = options(cs);
  o.expert_bias = false;
  MoE stacked(o);
  o.expert_unit_size = 2;
  MoE streamed(o);
  stacked->to(dev, torch::kBFloat16);
  streamed->to(dev, torch::kBFloat16);
  const auto bf16 = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
  torch::manual_seed(1);
  const auto x0 = torch::randn({kS, kD}, bf16);
  const auto probe = torch::randn_like(x0);
  std::vector<torch::Tensor> y, dx;
  int64_t forward_syncs = -1, backward_syncs = -1;
  for (MoE* m : {&stacked, &streamed}) {
    (*m)->set_call_index(4);
    auto x = x0.clone().requires_grad_(true);
    torch::Tensor out;
    const int64_t f = count_syncs([&] { out = (*m)->forward(x); });
    const int64_t b = count_syncs(
        [&] { (out.to(torch::kFloat) * probe.to(torch::kFloat)).sum().backward(); });
    if (m == &streamed) forward_syncs = f, backward_syncs = b;
    y.push_back(out.detach().to(torch::kFloat));
    dx.push_back(x.grad().to(torch::kFloat));
  }
  EXPECT_EQ(forward_syncs, 1);
  EXPECT_EQ(backward_syncs, 0);
  for (size_t i = 0; i < 2; ++i) {
    const auto& a = i == 0 ? y : dx;
    const double scale = a[0].abs().max().item<double>();
    EXPECT_LE((a[1] - a[0]).abs().max().item<double>(), 3e-2 * scale) << (i ? "d input" : "output");
  }
  for (const auto& u : streamed->experts->units()) {
    if (!u.w1.grad().defined()) continue;
    const auto want = stacked->experts->w1.grad().narrow(0, u.first, u.count).to(torch::kFloat);
    const double scale = want.abs().max().item<double>();
    EXPECT_LE((u.w1.grad().to(torch::kFloat) - want).abs().max().item<double>(), 3e-2 * scale) << u.name;
  }
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

}  // namespace
