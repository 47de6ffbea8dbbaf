// The C++ side of runtime/nn's CUDA kernels: element types, the current stream, the device's
// multiprocessors, a launch's error. Included by the layers' .cpp files only when
// STRATA_HAS_CUDA; the kernels themselves (cuda/*.cu) see none of LibTorch.
#pragma once

#include <torch/torch.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <string>

#include "runtime/error.h"
#include "runtime/nn/cuda/launch.h"

namespace strata::nn::detail {

inline std::optional<cuda::FloatType> kernel_type(torch::ScalarType t) {
  if (t == torch::kFloat) return cuda::FloatType::kFloat32;
  if (t == torch::kBFloat16) return cuda::FloatType::kBFloat16;
  if (t == torch::kHalf) return cuda::FloatType::kFloat16;
  return std::nullopt;
}

inline void* current_stream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline int multiprocessors() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

inline void check_launch(const char* error, const char* what) {
  if (error != nullptr)
    throw Error(std::string(what) + ": the CUDA kernel did not launch: " + error);
}

}  // namespace strata::nn::detail
