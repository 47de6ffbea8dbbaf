// CUDA tensors go into checkpoint and safetensors files as their bytes and come back on the CPU
// (the engine copies them onto its device). Skipped without CUDA.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/tensor_file.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

namespace ckpt = strata::checkpoint;

TEST(CheckpointGpu, CudaTensorsAreSavedAndLoadOnTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  strata::test::ScratchDir dir;
  const auto cpu = torch::randn({64, 33}).to(torch::kBFloat16);
  const auto flat = cpu.to(torch::kCUDA).reshape({-1});
  const ckpt::NamedTensors tensors = {{"w", cpu.to(torch::kCUDA)},
                                      {"shard", flat.narrow(0, 100, 500)},  // a view on the GPU
                                      {"t", cpu.to(torch::kCUDA).t()}};
  const std::string path = (dir.path() / "gpu.ckpt").string();
  ckpt::save_tensor_file(path, tensors);
  const auto file = ckpt::load_tensor_file(path, ckpt::specs_of(tensors));
  for (const auto& [name, t] : tensors) {
    EXPECT_EQ(file.at(name).device(), torch::Device(torch::kCPU)) << name;
    EXPECT_TRUE(torch::equal(file.at(name), t.cpu())) << name;
  }
  const std::string st = (dir.path() / "gpu.safetensors").string();
  ckpt::save_safetensors(st, tensors);
  const auto back = ckpt::load_safetensors(st);
  for (const auto& [name, t] : tensors) EXPECT_TRUE(torch::equal(back.at(name), t.cpu())) << name;
}
