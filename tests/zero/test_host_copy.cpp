// zero/host_copy.h's page_locked_empty: exactly the bytes asked for, 4096-aligned; on a GPU
// (skipped without one) page-locked, so that copies to and from the device are asynchronous.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>

#include "zero/host_copy.h"

namespace {

using strata::zero::page_locked_empty;

TEST(PageLockedEmpty, OnTheCpuAlignedPageableMemoryOfTheSizeAsked) {
  auto t = page_locked_empty(1001, torch::kBFloat16, torch::kCPU);
  ASSERT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 1001);
  EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 4096, 0u);
  t.fill_(2.5);
  EXPECT_EQ(t.to(torch::kDouble).sum().item<double>(), 2.5 * 1001);
  EXPECT_EQ(page_locked_empty(0, torch::kFloat, torch::kCPU).numel(), 0);
}

TEST(PageLockedEmpty, OnTheGpuPageLockedAndCopiedAsynchronously) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  const torch::Device cuda(torch::kCUDA);
  const int64_t n = 5'000'003;  // not a power of two's bytes
  auto host = page_locked_empty(n, torch::kFloat, cuda);
  ASSERT_TRUE(host.defined());
  EXPECT_TRUE(host.is_pinned());
  EXPECT_EQ(host.numel(), n);
  auto source = torch::arange(n, torch::TensorOptions().dtype(torch::kFloat).device(cuda));
  host.copy_(source, /*non_blocking=*/true);
  auto back = torch::zeros_like(source);
  back.copy_(host, /*non_blocking=*/true);
  torch::cuda::synchronize();
  EXPECT_TRUE(back.equal(source));
  // Freed (unlocked, then released) with its last reference; another takes its place.
  host = torch::Tensor();
  EXPECT_TRUE(page_locked_empty(n, torch::kBFloat16, cuda).is_pinned());
}

}  // namespace
