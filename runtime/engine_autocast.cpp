// Engine::configure_autocast: DeepSpeed's fp16.auto_cast (the forward's floating inputs in the
// model's 16-bit dtype) and torch_autocast (LibTorch autocast over fp32 parameters;
// runtime/autocast.h).
#include <limits>
#include <string>
#include <unordered_set>
#include <vector>

#include "runtime/autocast.h"
#include "runtime/cpu_threads.h"
#include "runtime/engine.h"
#include "runtime/log.h"

namespace strata {

void Engine::configure_autocast() {
  const auto& fp16 = config_.fp16;
  if (fp16.auto_cast) {
    // DeepSpeed casts to fp16 whatever the model's dtype; Strata casts to the model's own 16-bit
    // dtype, so that a bf16 run of the same config gets inputs it can use.
    if (fp16.enabled)
      input_cast_dtype_ = torch::kHalf;
    else if (config_.bf16.enabled)
      input_cast_dtype_ = torch::kBFloat16;
    else
      log::info("[strata] warning: {}: fp16.auto_cast is set but the model trains in fp32 "
                "parameters; the forward's inputs are passed as they are",
                config_.source);
  }
  autocast_plan_ = plan_autocast(config_, device_, config_.zero_optimization.stage == 3);
  if (!autocast_plan_.enabled) return;
  std::vector<std::string> unmatched;
  std::unordered_set<const void*> safe;
  for (const auto& p : lower_precision_safe_parameters(*module_, config_.torch_autocast, &unmatched))
    safe.insert(p.unsafeGetTensorImpl());
  // Over 16-bit parameters (fp16/bf16 on as well, as DeepSpeed allows) that block's loss scale
  // and communication dtype apply; what follows is for fp32 parameters.
  model_cast_ = config_.fp16.enabled || config_.bf16.enabled;
  autocast_safe_params_only_ = true;
  for (const auto& p : params_) autocast_safe_params_only_ &= safe.count(p.unsafeGetTensorImpl()) > 0;
  if (config_.torch_autocast.lower_precision_safe_modules)
    for (const auto& name : unmatched)
      log::info("[strata] warning: {}: torch_autocast.lower_precision_safe_modules names '{}', "
                "which is the type of no module of this model",
                config_.source, name);
  if (autocast_plan_.dtype == torch::kHalf && !model_cast_) {
    // torch.amp.GradScaler's defaults, as DeepSpeed uses it with fp16 autocast: 2^16, doubled
    // after 2000 good steps, halved (and the step skipped) on every overflow.
    DynamicLossScaleOptions scale;
    scale.init_scale = 65536.0;
    scale.scale_window = 2000;
    scale.delayed_shift = 1;
    scale.min_scale = std::numeric_limits<float>::min();
    scale.raise_error_at_min_scale = false;
    scale.growth = GrowthRule::kLegacyModulo;
    scaler_ = LossScaler::make_dynamic(scale);
    skip_on_overflow_ = true;
  }
  log::info("[strata] torch_autocast: forward under {} autocast in {} over {} parameters; "
            "gradients reduced in {}",
            autocast_plan_.device == c10::DeviceType::CUDA ? "CUDA" : "CPU",
            c10::toString(autocast_plan_.dtype), c10::toString(params_.front().scalar_type()),
            c10::toString(gradient_comm_dtype()));
  if (autocast_plan_.device == c10::DeviceType::CPU && autocast_plan_.dtype == torch::kBFloat16 &&
      !cpu_has_onednn_bf16())
    log::info("[strata] warning: {}: torch_autocast bf16 on a CPU without AVX-512 (BW, VL, DQ): "
              "LibTorch multiplies bf16 in a reference loop here, many times slower than fp32 "
              "(30x with LibTorch 1.13); train in fp32 on this machine",
              config_.source);
}

}  // namespace strata
