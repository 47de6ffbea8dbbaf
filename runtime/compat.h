// Differences between LibTorch 1.13 (Debian's libtorch-dev, CPU) and LibTorch 2.x live here and
// nowhere else.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#define STRATA_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#include <ATen/autocast_mode.h>

namespace strata::compat {

// Autocast's per-device state: LibTorch 2.4 takes the device type as an argument (and deprecates
// the per-device functions); 1.13 has one function per device. Strata autocasts CPU and CUDA.
inline bool autocast_enabled(c10::DeviceType device) {
#if STRATA_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if STRATA_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CUDA)
    at::autocast::set_enabled(enabled);
  else
    at::autocast::set_cpu_enabled(enabled);
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if STRATA_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                         : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if STRATA_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA)
    at::autocast::set_autocast_gpu_dtype(dtype);
  else
    at::autocast::set_autocast_cpu_dtype(dtype);
#endif
}

// CPU autocast runs bf16 in every version; fp16 only from LibTorch 2.4 (1.13 warns and turns
// autocast off for it, so Strata refuses it instead).
constexpr bool kCpuAutocastHasFp16 = STRATA_TORCH_AT_LEAST(2, 4);

}  // namespace strata::compat

// LibTorch 1.13's CPU layer_norm refuses a bf16 input with fp32 weights, and its CPU autocast
// leaves layer_norm alone, so a model with LayerNorm fails under bf16 autocast; 2.x normalises
// such mixed inputs itself. Below 2.0 runtime/autocast.cpp registers layer_norm as an fp32 op of
// CPU autocast.
#define STRATA_CPU_AUTOCAST_NEEDS_FP32_LAYER_NORM (!STRATA_TORCH_AT_LEAST(2, 0))

namespace strata::compat {

}  // namespace strata::compat
