#include "zero/host_copy.h"

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

}  // namespace strata::zero
