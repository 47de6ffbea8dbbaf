// Exact resume of a model with dropout on one GPU: its masks come from the CUDA device's
// generator, whose state the checkpoint keeps beside the CPU's (runtime/checkpoint/rng_state.h).
// 6 steps straight equal 3, save, a fresh engine (same seed, new model), load, 3 more, bit for
// bit. The CPU case, and 2 ranks: test_engine_user_model.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <string>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/engine.h"

namespace {

#if STRATA_TEST_HAS_CUDA
struct DropoutNetImpl : torch::nn::Module {
  DropoutNetImpl() {
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                                                       torch::nn::Dropout(0.3),
                                                       torch::nn::Linear(64, 1)));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return (net->forward(x.to(torch::kBFloat16)).to(torch::kFloat) - y).pow(2).mean();
  }
  torch::nn::Sequential net{nullptr};
};
TORCH_MODULE(DropoutNet);

template <class E>
void train(E& engine, int64_t from, int64_t to) {
  const torch::Device device(torch::kCUDA, 0);
  for (int64_t step = from; step < to; ++step) {
    auto gen = at::detail::createCPUGenerator(uint64_t(500 + step));  // not dropout's generator
    auto x = torch::randn({8, 16}, gen).to(device);
    auto y = x.sum(1, true).sin();
    engine->backward(engine->forward(x, y));
    engine->step();
  }
}

DropoutNet on_gpu() {
  torch::manual_seed(1);  // seeds every CUDA device's generator too
  DropoutNet net;
  net->to(torch::Device(torch::kCUDA, 0));
  return net;
}
#endif

TEST(EngineGpuDropout, ResumesBitForBitOnOneGpu) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", 8}, {"steps_per_print", 1000000},
      {"bf16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 2}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
  const std::string dir = testing::TempDir() + "/gpu_dropout_" + std::to_string(getpid());
  strata::checkpoint::remove_tree(dir);
  auto straight = on_gpu();
  auto a = strata::initialize(straight, config);
  train(a, 0, 6);
  auto first = on_gpu();
  auto b = strata::initialize(first, config);
  train(b, 0, 3);
  b->save_checkpoint(dir, "t");
  auto resumed = on_gpu();
  auto r = strata::initialize(resumed, config);
  r->load_checkpoint(dir);
  train(r, 3, 6);
  auto want = straight->named_parameters();
  for (const auto& p : resumed->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
  strata::checkpoint::remove_tree(dir);
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

}  // namespace
