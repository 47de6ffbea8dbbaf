// What every strata-bench subcommand needs of the device: which one (--device), waiting for it,
// its matrix-product peak in this run and the caching allocator's peaks (the peers' figures).
// STRATA_BENCH_CUDA is strata-bench's compile definition.
#pragma once

#include <chrono>
#include <string>

#if STRATA_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <torch/cuda.h>
#include <torch/torch.h>

namespace strata::bench {

// --device cuda or cpu; none given: the first GPU when there is one.
inline torch::Device bench_device(const std::string& flag) {
  if (flag == "cuda" || (flag.empty() && torch::cuda::is_available()))
    return torch::Device(torch::kCUDA, 0);
  return torch::kCPU;
}

inline void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

// The peak of a square matrix product in this run (bf16 on GPUs, fp32 on CPUs), TFLOP/s.
inline double matmul_peak(const torch::Device& device) {
  const int64_t n = device.is_cuda() ? 8192 : 1024;
  const auto options = torch::TensorOptions().device(device).dtype(
      device.is_cuda() ? torch::kBFloat16 : torch::kFloat);
  auto a = torch::randn({n, n}, options), b = torch::randn({n, n}, options);
  for (int i = 0; i < 3; ++i) torch::mm(a, b);
  synchronize(device);
  const auto t0 = std::chrono::steady_clock::now();
  const int reps = 10;
  for (int i = 0; i < reps; ++i) torch::mm(a, b);
  synchronize(device);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return reps * 2.0 * n * n * n / s / 1e12;
}

// The caching allocator's peak of allocated (the peers' max_memory_allocated) or of reserved bytes.
inline double peak_memory_gib(const torch::Device& device, bool reserved = false) {
#if STRATA_BENCH_CUDA
  if (device.is_cuda()) {
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return (reserved ? stats.reserved_bytes[0].peak : stats.allocated_bytes[0].peak) /
           double(1 << 30);
  }
#endif
  (void)reserved;
  return 0.0;
}

inline void reset_peak_memory(const torch::Device& device) {
#if STRATA_BENCH_CUDA
  if (device.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
}

}  // namespace strata::bench
