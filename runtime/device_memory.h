// The caching allocator's view of a CUDA device's memory, for a program's own reports (train_gpt's
// metrics): bytes allocated now and the most allocated since the last reset. Not measurable on a
// CPU device (or in a build without CUDA): std::nullopt there.
#pragma once

#include <cstdint>
#include <optional>

#include <torch/torch.h>

namespace strata {

struct DeviceMemory {
  int64_t allocated = 0;  // bytes the caching allocator has handed out now
  int64_t peak = 0;       // the most it had handed out at once since the last reset
};

std::optional<DeviceMemory> device_memory(const torch::Device& device);
// Starts a new peak at what is allocated now (the peers' torch.cuda.reset_peak_memory_stats).
void reset_device_memory_peak(const torch::Device& device);

}  // namespace strata
