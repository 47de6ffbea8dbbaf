#include "runtime/autocast.h"

#include <fmt/format.h>

#include <torch/library.h>

#include <unordered_set>

#include "runtime/compat.h"
#include "runtime/error.h"

namespace strata {
namespace {

// DeepSpeed's LOWER_PRECISION_SAFE_MODULES.
const std::vector<std::string> kDefaultSafeModules = {"torch.nn.Linear", "torch.nn.Conv1d",
                                                      "torch.nn.Conv2d", "torch.nn.Conv3d"};

// "torch.nn.Linear" -> "torch::nn::LinearImpl" (LibTorch's name() of the module); other names as
// they are, for the program's own module types.
std::string libtorch_module_name(const std::string& name) {
  const std::string prefix = "torch.nn.";
  if (name.rfind(prefix, 0) != 0) return name;
  return "torch::nn::" + name.substr(prefix.size()) + "Impl";
}

#if STRATA_CPU_AUTOCAST_NEEDS_FP32_LAYER_NORM
// layer_norm in CPU autocast's fp32 policy: input, weight and bias in fp32 (compat.h says why).
at::Tensor layer_norm_in_fp32(const at::Tensor& input, at::IntArrayRef normalized_shape,
                              const c10::optional<at::Tensor>& weight,
                              const c10::optional<at::Tensor>& bias, double eps, bool cudnn_enable) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  auto fp32 = [](const c10::optional<at::Tensor>& t) -> c10::optional<at::Tensor> {
    if (t && t->defined() && t->is_floating_point() && t->scalar_type() != at::kDouble)
      return t->to(at::kFloat);
    return t;
  };
  const bool lower = input.is_floating_point() && input.scalar_type() != at::kDouble;
  return at::layer_norm(lower ? input.to(at::kFloat) : input, normalized_shape, fp32(weight),
                        fp32(bias), eps, cudnn_enable);
}

TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) { m.impl("layer_norm", TORCH_FN(layer_norm_in_fp32)); }
#endif

}  // namespace

torch::ScalarType torch_autocast_dtype(const TorchAutocastConfig& config) {
  for (const char* name : {"float16", "fp16", "half", "torch.float16"})
    if (config.dtype == name) return torch::kHalf;
  return torch::kBFloat16;  // the schema allows only the two lower-precision dtypes
}

AutocastPlan plan_autocast(const Config& config, const torch::Device& device, bool stage3) {
  AutocastPlan plan;
  plan.device = device.type();
  plan.enabled = config.torch_autocast.enabled;
  if (!plan.enabled) return plan;
  plan.dtype = torch_autocast_dtype(config.torch_autocast);
  plan.cache = !stage3;
  if (!device.is_cpu() && !device.is_cuda())
    throw Error(fmt::format("{}: torch_autocast.enabled: the model is on {}; Strata autocasts "
                            "models on CPU or CUDA",
                            config.source, device.str()));
  if (device.is_cpu() && plan.dtype == torch::kHalf && !compat::kCpuAutocastHasFp16)
    throw Error(fmt::format("{}: torch_autocast.dtype = \"{}\": this LibTorch ({}) autocasts CPU "
                            "models in bfloat16 only (fp16 from 2.4); use \"bfloat16\" or a GPU",
                            config.source, config.torch_autocast.dtype, TORCH_VERSION));
  return plan;
}

std::vector<torch::Tensor> lower_precision_safe_parameters(torch::nn::Module& model,
                                                           const TorchAutocastConfig& config,
                                                           std::vector<std::string>* unmatched) {
  const auto& names = config.lower_precision_safe_modules ? *config.lower_precision_safe_modules
                                                          : kDefaultSafeModules;
  std::unordered_set<std::string> wanted, seen_types;
  for (const auto& n : names) wanted.insert(libtorch_module_name(n));
  std::vector<torch::Tensor> params;
  std::unordered_set<const void*> seen;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    const std::string type = module->name();
    if (!wanted.count(type)) continue;
    seen_types.insert(type);
    for (const auto& p : module->parameters(/*recurse=*/false))
      if (seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  }
  if (unmatched)
    for (const auto& n : names)
      if (!seen_types.count(libtorch_module_name(n))) unmatched->push_back(n);
  return params;
}

AutocastScope::AutocastScope(const AutocastPlan& plan) : device_(plan.device) {
  was_enabled_ = compat::autocast_enabled(device_);
  if (!plan.enabled && !was_enabled_) return;
  active_ = true;
  was_dtype_ = compat::autocast_dtype(device_);
  was_caching_ = at::autocast::is_autocast_cache_enabled();
  if (plan.enabled) {
    compat::set_autocast_dtype(device_, plan.dtype);
    at::autocast::set_autocast_cache_enabled(plan.cache);
  }
  compat::set_autocast_enabled(device_, plan.enabled);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // As torch.autocast's __exit__: the outermost scope drops the cached casts of the weights.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, was_enabled_);
  compat::set_autocast_dtype(device_, was_dtype_);
  at::autocast::set_autocast_cache_enabled(was_caching_);
}

}  // namespace strata
