// The boundary between the C++ side (tensors, streams) and the fused Adam kernel (nvcc, no
// LibTorch headers): raw pointers, the element types, the stream.
#pragma once

#include <cstdint>

#include "offload/adam_math.h"

namespace strata::optim::cuda {

enum class FloatType : int { kFloat32, kBFloat16, kFloat16 };

struct FusedAdamLaunch {
  float* master = nullptr;  // fp32, n elements, updated in place
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;  // n elements of grad_type
  FloatType grad_type = FloatType::kFloat32;
  void* out = nullptr;  // n elements of out_type receive the new weights; null: none
  FloatType out_type = FloatType::kBFloat16;
  int64_t n = 0;
  AdamScalars scalars;
  void* stream = nullptr;  // cudaStream_t
  int multiprocessors = 0;
};

// Enqueues the step on the stream; returns null, or CUDA's error text.
const char* launch_fused_adam(const FusedAdamLaunch& launch);

}  // namespace strata::optim::cuda
