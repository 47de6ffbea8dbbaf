// runtime/nn's CUDA kernels (RMSNorm, rotary embedding, SwiGLU, the fused loss's softmax) against Hugging Face's formulas
// written op by op on the same GPU: values and gradients (bit for bit where the kernel rounds each
// product as LibTorch does and nvcc cannot fuse a multiply-add; within rounding elsewhere), in the
// layouts the models pass; and under ZeRO-3, where the kernel's reads of a released weight must
// gather it like any op's: the losses of stage 0 and the norm's unit gathered in forward and in
// backward. Skips without a CUDA device.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <utility>
#include <torch/torch.h>

#include "runtime/compat.h"
#include "runtime/device_memory.h"
#include "runtime/engine.h"
#include "runtime/nn/grouped_attention.h"
#include "runtime/nn/linear_cross_entropy.h"
#include "runtime/nn/rms_norm.h"
#include "runtime/nn/rotary.h"
#include "runtime/nn/swiglu.h"

namespace strata::test::fused_layers_gpu {
namespace {

namespace F = torch::nn::functional;

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (or this LibTorch has no CUDA)"

const torch::Device kCuda(torch::kCUDA, 0);

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max() /
          b.to(torch::kDouble).abs().max().clamp_min(1e-30))
      .item<double>();
}

// The share of elements that are equal.
double same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.eq(b).to(torch::kDouble).mean().item<double>();
}

struct Run {
  torch::Tensor y;
  std::vector<torch::Tensor> grads;
};

template <class Fn>
Run run(Fn&& f, std::vector<torch::Tensor> inputs, const torch::Tensor& probe) {
  for (auto& t : inputs) t = t.detach().clone().requires_grad_(true);
  auto y = f(inputs);
  (y.to(torch::kFloat) * probe).sum().backward();
  Run r{y.detach(), {}};
  for (auto& t : inputs) r.grads.push_back(t.grad());
  return r;
}

torch::Tensor rotary_op_by_op(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin) {
  const auto half = x.size(-1) / 2;
  return x * cos + torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
}

TEST(FusedLayersGpu, RotaryIsTheCompositeBitForBitInBf16) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(1);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    // [b, t, h, d] viewed as [b, h, t, d], the tables a window of longer ones.
    const auto x = torch::randn({2, 300, 4, 64}, kCuda).to(dtype).transpose(1, 2);
    const auto angles = torch::rand({400, 32}, kCuda) * 100;
    const auto cos_all = torch::cat({angles, angles}, -1).cos().to(dtype);
    const auto sin_all = torch::cat({angles, angles}, -1).sin().to(dtype);
    const auto cos = cos_all.narrow(0, 50, 300), sin = sin_all.narrow(0, 50, 300);
    const auto probe = torch::randn({2, 4, 300, 64}, kCuda);
    const auto got = run([&](auto& in) { return nn::rotary(in[0], cos, sin); }, {x}, probe);
    const auto want = run([&](auto& in) { return rotary_op_by_op(in[0], cos, sin); }, {x}, probe);
    EXPECT_TRUE(got.y.strides() == x.strides()) << "the kernel writes in x's layout";
    if (dtype == torch::kFloat) {  // nvcc fuses x1 * c1 - x2 * s1 into one rounding
      EXPECT_LE(rel(got.y, want.y), 1e-6);
      EXPECT_LE(rel(got.grads[0], want.grads[0]), 1e-6);
    } else {
      EXPECT_TRUE(got.y.equal(want.y));
      EXPECT_TRUE(got.grads[0].equal(want.grads[0]));
    }
  }
}

TEST(FusedLayersGpu, SwiGluIsTheCompositeWithinRounding) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    for (const int64_t width : {4096, 333}) {  // packed 16-byte loads, and not
      const auto gate = (torch::randn({64, width}, kCuda) * 4).to(dtype);
      const auto up = torch::randn({64, width}, kCuda).to(dtype);
      const auto probe = torch::randn({64, width}, kCuda);
      const auto got = run([](auto& in) { return nn::swiglu(in[0], in[1]); }, {gate, up}, probe);
      const auto want = run([](auto& in) { return F::silu(in[0]) * in[1]; }, {gate, up}, probe);
      const double tol = dtype == torch::kFloat ? 1e-6 : 1e-2;
      EXPECT_LE(rel(got.y, want.y), tol);
      EXPECT_LE(rel(got.grads[0], want.grads[0]), tol);
      EXPECT_LE(rel(got.grads[1], want.grads[1]), tol);
      // The same function rounded the same way: differences are rare last-bit ones.
      EXPECT_GE(same(got.y, want.y), 0.999);
      EXPECT_GE(same(got.grads[1], want.grads[1]), 0.999);
      EXPECT_GE(same(got.grads[0], want.grads[0]), 0.99);
      // The packed form over [gate | up] halves of one tensor.
      const auto packed = torch::cat({gate, up}, -1);
      const auto got_packed = run([](auto& in) { return nn::swiglu(in[0]); }, {packed}, probe);
      EXPECT_TRUE(got_packed.y.equal(got.y));
      EXPECT_TRUE(got_packed.grads[0].equal(torch::cat({got.grads[0], got.grads[1]}, -1)));
    }
  }
}

torch::Tensor rms_op_by_op(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const auto xf = x.to(torch::kFloat);
  return w * (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

TEST(FusedLayersGpu, RmsNormIsHuggingFacesFormulaWithinRounding) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  struct Case {
    torch::ScalarType x, w;
    int64_t rows, cols;
    double tol;
  };
  // Llama's hidden rows, Qwen3's per-head q/k norm rows, a width that is no multiple of 8,
  // autocast's fp32 weight on bf16 rows.
  for (const auto& c : {Case{torch::kFloat, torch::kFloat, 1000, 2048, 1e-5},
                        Case{torch::kBFloat16, torch::kBFloat16, 4096, 2048, 2e-2},
                        Case{torch::kBFloat16, torch::kBFloat16, 20000, 128, 2e-2},
                        Case{torch::kHalf, torch::kHalf, 300, 1000, 5e-3},
                        Case{torch::kBFloat16, torch::kFloat, 500, 768, 2e-2},
                        // The row-group kernel's shapes: a last pack chunk half full, four chunks
                        // of fp32, 16-bit rows of four chunks, of a few packs, and one too wide
                        // for it (the warp-per-row kernel).
                        Case{torch::kBFloat16, torch::kBFloat16, 301, 3072, 2e-2},
                        Case{torch::kFloat, torch::kFloat, 37, 4096, 1e-5},
                        Case{torch::kHalf, torch::kHalf, 129, 8192, 5e-3},
                        Case{torch::kBFloat16, torch::kBFloat16, 999, 24, 2e-2},
                        Case{torch::kBFloat16, torch::kBFloat16, 70, 12288, 2e-2}}) {
    SCOPED_TRACE(std::string(c10::toString(c.x)) + " rows of " + std::to_string(c.cols) + ", " +
                 c10::toString(c.w) + " weight");
    const auto x = (torch::randn({c.rows, c.cols}, kCuda) * 3).to(c.x);
    const auto w = (1 + 0.1 * torch::randn({c.cols}, kCuda)).to(c.w);
    const auto probe = torch::randn({c.rows, c.cols}, kCuda);
    const auto got = run([](auto& in) { return nn::rms_norm(in[0], in[1], 1e-5); }, {x, w}, probe);
    const auto want = run([](auto& in) { return rms_op_by_op(in[0], in[1], 1e-5); }, {x, w}, probe);
    EXPECT_EQ(got.y.scalar_type(), want.y.scalar_type());
    EXPECT_EQ(got.grads[1].scalar_type(), c.w);
    EXPECT_LE(rel(got.y, want.y), c.tol);
    EXPECT_LE(rel(got.grads[0], want.grads[0]), c.tol);
    EXPECT_LE(rel(got.grads[1], want.grads[1]), c.tol);
    if (c.x != torch::kFloat) {
      EXPECT_GE(same(got.y, want.y), 0.99);
    }
  }
}

// The kernel is the point of the layer: forward + backward of Llama's hidden rows and of Qwen3's
// per-head rows faster than the op-by-op formula (the models' RMSNorm before the kernel), and the
// weight's gradient alone (x not requiring one) the formula's too.
TEST(FusedLayersGpu, RmsNormKernelIsFasterThanTheFormula) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(6);
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{8192, 2048}, {262144, 128}}) {
    const auto x = torch::randn({rows, cols}, kCuda).to(torch::kBFloat16).requires_grad_(true);
    const auto w = torch::ones({cols}, kCuda).to(torch::kBFloat16).requires_grad_(true);
    const auto dy = torch::randn({rows, cols}, kCuda).to(torch::kBFloat16);
    auto time = [&](auto&& norm) {
      for (int i = 0; i < 3; ++i) norm(x, w).backward(dy);
      torch::cuda::synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      constexpr int kIters = 20;
      for (int i = 0; i < kIters; ++i) norm(x, w).backward(dy);
      torch::cuda::synchronize();
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
             kIters;
    };
    const double kernel = time([](auto& a, auto& b) { return nn::rms_norm(a, b, 1e-5); });
    const double formula = time([](auto& a, auto& b) { return rms_op_by_op(a, b, 1e-5); });
    std::printf("rms_norm [%ld, %ld] bf16 forward + backward: kernel %.1f us, formula %.1f us\n",
                long(rows), long(cols), kernel, formula);
    EXPECT_LT(kernel, formula) << rows << " x " << cols;
    const auto gw = [&](bool fused) {
      const auto xd = x.detach();
      auto* wg = &w.mutable_grad();
      *wg = torch::Tensor();
      (fused ? nn::rms_norm(xd, w, 1e-5) : rms_op_by_op(xd, w, 1e-5)).backward(dy);
      return w.grad().clone();
    };
    EXPECT_LE(rel(gw(true), gw(false)), 2e-2) << "the weight's gradient alone";
  }
}

// Attention one kv head's group per flash call (long sequences' layout): the output and the
// gradients of SDPA's one call (within bf16's rounding; flash computes every head on its own), and
// a smaller peak of backward (one group's dq accumulator and expanded dk/dv at a time).
TEST(FusedLayersGpu, GroupedAttentionIsSdpasCallWithASmallerBackwardPeak) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(9);
  const int64_t b = 1, heads = 32, kv = 8, t = 16384, d = 64;
  auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(kCuda);
  // [b, t, heads, d] in memory, as the model's projections give them.
  const auto q = torch::randn({b, t, heads, d}, bf16).transpose(1, 2),
             k = torch::randn({b, t, kv, d}, bf16).transpose(1, 2),
             v = torch::randn({b, t, kv, d}, bf16).transpose(1, 2), dy = torch::randn({b, heads, t, d}, bf16);
  ASSERT_TRUE(nn::grouped_attention_runs(q, k, 1)) << "LibTorch 2.2+ on a CUDA device";
  auto attend = [&](bool grouped, const torch::Tensor& qi, const torch::Tensor& ki, const torch::Tensor& vi) {
#if STRATA_TORCH_AT_LEAST(2, 5)
    return grouped ? nn::grouped_attention(qi, ki, vi, 1)
                   : at::scaled_dot_product_attention(qi, ki, vi, {}, 0.0, /*is_causal=*/true,
                                                      std::nullopt, /*enable_gqa=*/true);
#else
    return qi;  // not reached: grouped_attention_runs is false before LibTorch 2.2
#endif
  };
  auto pass = [&](bool grouped, int64_t& peak) {
    auto qi = q.detach().requires_grad_(true), ki = k.detach().requires_grad_(true),
         vi = v.detach().requires_grad_(true);
    auto y = attend(grouped, qi, ki, vi);
    torch::cuda::synchronize();
    reset_device_memory_peak(kCuda);
    const auto before = device_memory(kCuda)->allocated;
    y.backward(dy);
    torch::cuda::synchronize();
    peak = device_memory(kCuda)->peak - before;
    return std::vector<torch::Tensor>{y.detach(), qi.grad(), ki.grad(), vi.grad()};
  };
  int64_t peak_sdpa = 0, peak_grouped = 0;
  const auto want = pass(false, peak_sdpa);
  const auto got = pass(true, peak_grouped);
  const char* names[] = {"output", "dq", "dk", "dv"};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_LE(rel(got[i], want[i]), 1e-2) << names[i];
  std::printf("attention backward at %ld tokens, %ld heads / %ld kv: peak %.1f MB in one call, "
              "%.1f MB one kv head per call\n",
              long(t), long(heads), long(kv), peak_sdpa / 1e6, peak_grouped / 1e6);
  EXPECT_LT(peak_grouped, peak_sdpa);
  // Forward + backward time: the groups run SDPA's own choice of kernels (cuDNN's on Hopper).
  auto time = [&](bool grouped) {
    auto qi = q.detach().requires_grad_(true), ki = k.detach().requires_grad_(true),
         vi = v.detach().requires_grad_(true);
    attend(grouped, qi, ki, vi).backward(dy);
    torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    constexpr int kIters = 5;
    for (int i = 0; i < kIters; ++i) attend(grouped, qi, ki, vi).backward(dy);
    torch::cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / kIters;
  };
  const double sdpa_ms = time(false), grouped_ms = time(true);
  std::printf("attention forward + backward at %ld tokens: %.2f ms in one call, %.2f ms one kv head "
              "per call\n", long(t), sdpa_ms, grouped_ms);
  // At 16K tokens 8 calls' overheads show (H100, cuDNN's kernels: 10.3 against 8.6 ms); the model
  // uses the groups from 16K positions on and at 128K runs 5% under its one-call speed.
  EXPECT_LT(grouped_ms, 1.3 * sdpa_ms);
}

// The fused head + loss's kernel (softmax cross-entropy in place over each chunk's logits) against
// LibTorch's linear + cross_entropy: ignored targets, chunks that do not divide the rows, a vocabulary
// that is no multiple of 8 (unpacked loads).
TEST(FusedLayersGpu, LinearCrossEntropyKernelIsTorchsWithinRounding) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(5);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const int64_t vocab : {4096, 1001}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", vocab " + std::to_string(vocab));
      const auto h = torch::randn({300, 64}, kCuda).to(dtype);
      const auto w = (torch::randn({vocab, 64}, kCuda) * 0.3).to(dtype);
      auto targets = torch::randint(0, vocab, {300}, torch::TensorOptions(kCuda).dtype(torch::kLong));
      targets.narrow(0, 10, 20).fill_(-100);
      const auto probe = torch::ones({}, kCuda);
      nn::LinearCrossEntropyOptions options;
      options.chunk_rows = 128;
      const auto got = run([&](auto& in) { return nn::linear_cross_entropy(in[0], in[1], targets, options); },
                           {h, w}, probe);
      const auto want = run([&](auto& in) {
        return F::cross_entropy(F::linear(in[0], in[1]).to(torch::kFloat), targets);
      }, {h, w}, probe);
      const double tol = dtype == torch::kFloat ? 1e-5 : 2e-2;
      EXPECT_LE(rel(got.y, want.y), dtype == torch::kFloat ? 1e-6 : 1e-3);
      EXPECT_LE(rel(got.grads[0], want.grads[0]), tol);
      EXPECT_LE(rel(got.grads[1], want.grads[1]), tol);
      EXPECT_TRUE(got.grads[0].narrow(0, 10, 20).eq(0).all().item<bool>());
    }
  }
}

struct NormImpl : torch::nn::Module {
  NormImpl() { weight = register_parameter("weight", torch::ones({32})); }
  torch::Tensor weight;
};
TORCH_MODULE(Norm);

// Embedding -> Linear -> SwiGLU -> RMSNorm -> head, every module its own ZeRO-3 unit.
struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    embed = register_module("embed", torch::nn::Embedding(64, 32));
    proj = register_module("proj", torch::nn::Linear(32, 64));
    norm = register_module("norm", Norm());
    head = register_module("head", torch::nn::Linear(32, 64));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto h = proj(embed(x));
    h = nn::swiglu(h.narrow(-1, 0, 32).contiguous(), h.narrow(-1, 32, 32).contiguous());
    h = nn::rms_norm(h, norm->weight, 1e-6);
    return F::cross_entropy(head(h).reshape({-1, 64}), y.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear proj{nullptr}, head{nullptr};
  Norm norm{nullptr};
};
TORCH_MODULE(NormNet);

TEST(FusedLayersGpu, ZeroStage3GathersTheNormsWeightForTheKernelBothWays) {
  SKIP_WITHOUT_CUDA();
  std::vector<float> losses[2];
  for (const int stage : {0, 3}) {
    torch::manual_seed(4);
    NormNet net;
    net->to(kCuda);
    json config = {{"train_batch_size", 4},
                   {"steps_per_print", 1000},
                   {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
                   {"zero_optimization",
                    {{"stage", stage},
                     {"stage3_param_persistence_threshold", 0},
                     {"stage3_max_reuse_distance", 0}}}};
    if (stage != 3) config["zero_optimization"].erase("stage3_max_reuse_distance");
    if (stage != 3) config["zero_optimization"].erase("stage3_param_persistence_threshold");
    auto engine = initialize(net, config);
    const zero::ParamUnits* units = stage == 3 ? engine->stage3_units() : nullptr;
    int64_t norm_unit = -1;
    if (units)
      for (size_t u = 0; u < units->size(); ++u)
        for (const auto& n : units->unit(u).names)
          if (n == "norm.weight") norm_unit = int64_t(u);
    if (units) {
      ASSERT_GE(norm_unit, 0);
    }
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(100);  // one batch every step: its loss must fall
      const auto x = torch::randint(0, 64, {4, 8}).to(kCuda);
      const auto y = torch::randint(0, 64, {4, 8}).to(kCuda);
      const int64_t before = units ? units->unit(size_t(norm_unit)).gathers : 0;
      auto loss = engine->forward(x, y);
      losses[stage == 3].push_back(loss.item<float>());
      engine->backward(loss);
      engine->step();
      if (units && step > 0) {  // step 1 records the trace
        EXPECT_EQ(units->unit(size_t(norm_unit)).gathers - before, 2) << "step " << step;
      }
    }
  }
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i) EXPECT_NEAR(losses[0][i], losses[1][i], 1e-5) << i;
  EXPECT_LT(losses[0].back(), losses[0].front());
}

}  // namespace
}  // namespace strata::test::fused_layers_gpu
