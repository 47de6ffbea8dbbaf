// What every strata-bench subcommand needs of the device: which one (--device), and waiting for it.
#pragma once

#include <string>

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

}  // namespace strata::bench
