// Activation checkpointing's stores on a CUDA device (skips without one): the contiguous buffer
// in page-locked host memory (contiguous_memory_optimization with cpu_checkpointing) brings the
// inputs back to the device for the recomputation, and a checkpoint whose inputs live on two
// devices (the hidden state on the GPU, a mask on the CPU) keeps one buffer per device, each
// counted as in use. Gradients equal the run without checkpointing (fp32, 1e-5 relative: the
// GPU's kernels may order sums differently between forward and recomputation, but here they
// run the same kernels on the same inputs, so the difference is that of the plain run's).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "runtime/checkpointing/checkpoint.h"
#include "runtime/checkpointing/saved_inputs.h"
#include "runtime/checkpointing/settings.h"

namespace {

namespace ckpt = strata::checkpointing;

#if STRATA_TEST_HAS_CUDA
struct MixImpl : torch::nn::Module {
  MixImpl() {
    fc = register_module("fc", torch::nn::Linear(16, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  }
  // hidden [B, T, 16]; mask [T, T] additive, on any device; scale [T, 1].
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& mask, const torch::Tensor& scale) {
    auto scores = torch::matmul(h, h.transpose(1, 2)) / 4.0 + mask.to(h.device());
    auto mixed = torch::matmul(torch::softmax(scores, -1), h) * scale.to(h.device());
    return h + fc(torch::gelu(norm(mixed)));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Mix);

// Block i takes masks[i] (each block its own: a store that lets one checkpoint's slice overwrite
// another's recomputes with the wrong mask).
std::vector<torch::Tensor> run(torch::nn::ModuleList& blocks, const torch::Tensor& x0,
                               const std::vector<torch::Tensor>& masks, const torch::Tensor& scale0,
                               bool checkpointed) {
  auto x = x0.clone().requires_grad_(true);
  auto scale = scale0.clone().requires_grad_(true);
  torch::Tensor h = x;
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto block = blocks->ptr<MixImpl>(i);
    const auto& mask = masks[i];
    h = checkpointed ? ckpt::checkpoint(block, h, mask, scale) : block->forward(h, mask, scale);
  }
  h.pow(2).sum().backward();
  std::vector<torch::Tensor> g;
  for (auto& p : blocks->parameters()) {
    g.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }
  g.push_back(x.grad());
  g.push_back(scale.grad());
  return g;
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(b[i].defined()) << what << " #" << i;
    ASSERT_TRUE(torch::isfinite(b[i]).all().item<bool>()) << what << " #" << i;
    const double scale = 1 + a[i].abs().max().item<double>();
    EXPECT_LE((a[i].cpu() - b[i].cpu()).abs().max().item<double>(), 1e-5 * scale)
        << what << " #" << i;
  }
}
#endif

TEST(CheckpointGpu, ContiguousBufferInHostMemoryAndInputsOnTwoDevices) {
#if !STRATA_TEST_HAS_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(3);
  torch::nn::ModuleList blocks;
  for (int i = 0; i < 3; ++i) blocks->push_back(Mix());
  blocks->to(torch::kCUDA);
  const int64_t B = 2, T = 8, D = 16;
  const auto x0 = torch::randn({B, T, D}, torch::kCUDA);
  const auto scale0 = (torch::rand({T, 1}) + 0.5).to(torch::kCUDA);
  const auto causal = torch::full({T, T}, -std::numeric_limits<float>::infinity()).triu(1);
  int owner = 0;
  for (const bool mask_on_cpu : {false, true}) {
    std::vector<torch::Tensor> masks;
    for (int i = 0; i < 3; ++i) {
      const auto m = causal + 0.3 * torch::randn({T, T});
      masks.push_back(mask_on_cpu ? m : m.to(torch::kCUDA));
    }
    const auto ref = run(blocks, x0, masks, scale0, false);
    for (const bool host : {false, true}) {
      const std::string what = std::string(host ? "contiguous + cpu_checkpointing" : "contiguous") +
                               (mask_on_cpu ? ", mask on the CPU" : ", mask on the GPU");
      ckpt::Settings s;
      s.contiguous = true;
      s.cpu_checkpointing = host;
      s.number_checkpoints = 3;
      ckpt::configure(&owner, s);
      for (int step = 0; step < 3; ++step) {  // the buffers are reused from their start
        expect_close(ref, run(blocks, x0, masks, scale0, true), what + ", step " + std::to_string(step));
        EXPECT_EQ(ckpt::store_stats().live, 0) << what;
      }
      ckpt::release(&owner);
    }
  }
#endif
}

}  // namespace
