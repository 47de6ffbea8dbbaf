#include "runtime/device_memory.h"

#if STRATA_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace strata {

#if STRATA_HAS_CUDA
namespace {
c10::DeviceIndex index_of(const torch::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
}  // namespace
#endif

std::optional<DeviceMemory> device_memory(const torch::Device& device) {
#if STRATA_HAS_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device));
    const auto& bytes = stats.allocated_bytes[0];  // the aggregate over both pools
    return DeviceMemory{bytes.current, bytes.peak};
  }
#endif
  (void)device;
  return std::nullopt;
}

void reset_device_memory_peak(const torch::Device& device) {
#if STRATA_HAS_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
#endif
  (void)device;
}

}  // namespace strata
