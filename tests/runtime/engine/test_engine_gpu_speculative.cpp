// offload_optimizer.super_offload on a GPU (zero/speculative_step.h): the speculative CPU step,
// begun during backward as the gradients land in host memory through asynchronous copies, leaves
// the fp32 master, both Adam moments and the model's weights bit for bit where the synchronous
// offloaded step leaves them, after every step of a run with an fp16 overflow (the step skipped:
// the speculation dropped), steps where clipping applies (redone) and steps where it does not
// (kept); fp16 and bf16, stages 1-3, gradient accumulation 2 (speculative_run.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "tests/runtime/engine/speculative_run.h"

namespace {

TEST(EngineGpuSpeculative, Fp16OverflowAndClippingGiveTheSynchronousStepBitForBit) {
#if STRATA_TEST_HAS_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device device(torch::kCUDA, 0);
  for (const std::string precision : {"fp16", "bf16"})
    for (int64_t stage : {1, 2, 3}) speculative_run::expect_speculation_exact(device, stage, precision);
#else
  GTEST_SKIP() << "this build of Strata has no CUDA";
#endif
}

}  // namespace
