#include "zero/host_copy.h"

#include <fmt/format.h>

#include "runtime/error.h"

#if STRATA_ZERO_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::zero {

void copy_to_host_async(const torch::Tensor& host, const torch::Tensor& source) {
#if STRATA_ZERO_HAS_CUDA
  if (source.is_cuda() && host.is_pinned()) {
    const auto index = source.device().index();
    // One side stream per device for the process (the pool hands out the same few streams).
    static thread_local c10::optional<c10::cuda::CUDAStream> side[64];
    auto& stream = side[index];
    if (!stream) stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(index));
    ready.block(*stream);
    c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), *stream);
    c10::cuda::CUDAStreamGuard guard(*stream);
    host.copy_(source, /*non_blocking=*/true);
    return;
  }
#endif
  host.copy_(source, /*non_blocking=*/host.is_pinned());
}

offload::Float host_float(torch::ScalarType type) {
  if (type == torch::kFloat) return offload::Float::kF32;
  if (type == torch::kBFloat16) return offload::Float::kBF16;
  if (type == torch::kHalf) return offload::Float::kF16;
  throw Error(fmt::format("optimizer offload: gradients in {} are not supported (fp32, bf16 or fp16)",
                          c10::toString(type)));
}

}  // namespace strata::zero
