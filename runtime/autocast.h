// The two ways a config lowers the precision of a forward without touching the model code:
//
// - fp16.auto_cast (DeepSpeed's _cast_inputs_half): the floating-point tensors passed to the
//   model's forward, also inside std::vector and std::tuple arguments, are cast to the model's
//   16-bit dtype before the call (cast_floating_inputs).
// - torch_autocast (DeepSpeed's runtime/torch_autocast.py): the parameters stay fp32 and the
//   forward runs under LibTorch's autocast for the model's device (AutocastScope), as PyTorch
//   AMP does. Which ops run in 16 bits is autocast's own policy. DeepSpeed marks the parameters
//   of lower_precision_safe_modules to have their gradients reduced (and, at stage 3, gathered)
//   in the autocast dtype; lower_precision_safe_parameters() finds them.
//
// What runs where: CPU autocast covers bf16 in LibTorch 1.13 (matmuls, linear, conv, bmm in bf16;
// softmax, losses, norms in fp32) and fp16 from 2.4; CUDA autocast covers bf16 and fp16.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "runtime/config/config.h"

namespace strata {

// torch_autocast resolved for the model's device.
struct AutocastPlan {
  bool enabled = false;
  c10::DeviceType device = c10::DeviceType::CPU;
  torch::ScalarType dtype = torch::kBFloat16;
  // Reuse one cast of each weight within a forward (autocast's cache). Off at stage 3: the cached
  // copies would keep every gathered unit's weights alive until the forward ends.
  bool cache = true;
};

// The config's dtype name (DeepSpeed's DtypeEnum spellings) as a dtype.
torch::ScalarType torch_autocast_dtype(const TorchAutocastConfig& config);

// The plan for a model on `device`; strata::Error when this build cannot autocast there.
AutocastPlan plan_autocast(const Config& config, const torch::Device& device, bool stage3);

// The parameters (each once) of the modules whose type lower_precision_safe_modules names:
// DeepSpeed's names ("torch.nn.Linear" is LibTorch's "torch::nn::LinearImpl") or a module's own
// name(). Unset: Linear and Conv1d/2d/3d, as DeepSpeed. `unmatched` receives the names that
// match no module of the model.
std::vector<torch::Tensor> lower_precision_safe_parameters(torch::nn::Module& model,
                                                           const TorchAutocastConfig& config,
                                                           std::vector<std::string>* unmatched = nullptr);

// torch.autocast's with-block around one forward. Enabled: autocast on for the plan's device and
// dtype, the cast cache cleared when the outermost scope ends (the weights change between
// forwards). Disabled while the program has autocast on around the engine: autocast off inside,
// as DeepSpeed's engine does (the config's precision decides). Otherwise it does nothing.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastPlan& plan);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  bool was_enabled_ = false;
  torch::ScalarType was_dtype_ = torch::kBFloat16;
  bool was_caching_ = true;
};

namespace autocast_detail {
template <class T>
struct IsTensorVector : std::false_type {};
template <>
struct IsTensorVector<std::vector<torch::Tensor>> : std::true_type {};
template <class T>
struct IsTuple : std::false_type {};
template <class... T>
struct IsTuple<std::tuple<T...>> : std::true_type {};

inline torch::Tensor cast_floating(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != dtype ? t.to(dtype) : t;
}
}  // namespace autocast_detail

// fp16.auto_cast for one forward argument: a floating-point tensor comes back cast to `dtype`
// (integer ones, e.g. token ids, as they are), a std::vector<Tensor> or std::tuple element-wise,
// anything else is forwarded untouched.
template <class Arg>
decltype(auto) cast_floating_inputs(Arg&& arg, torch::ScalarType dtype) {
  using T = std::decay_t<Arg>;
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    return autocast_detail::cast_floating(arg, dtype);
  } else if constexpr (autocast_detail::IsTensorVector<T>::value) {
    std::vector<torch::Tensor> cast;
    cast.reserve(arg.size());
    for (const auto& t : arg) cast.push_back(autocast_detail::cast_floating(t, dtype));
    return cast;
  } else if constexpr (autocast_detail::IsTuple<T>::value) {
    return std::apply(
        [dtype](const auto&... e) { return std::make_tuple(cast_floating_inputs(e, dtype)...); }, arg);
  } else {
    return std::forward<Arg>(arg);
  }
}

// Whether module->forward accepts the cast arguments (a forward taking a non-const Tensor&
// cannot receive a cast copy).
template <class Holder, class Void, class... Args>
struct AcceptsCastInputs : std::false_type {};
template <class Holder, class... Args>
struct AcceptsCastInputs<Holder,
                         std::void_t<decltype(std::declval<Holder&>()->forward(
                             cast_floating_inputs(std::declval<Args>(), torch::kHalf)...))>,
                         Args...> : std::true_type {};

}  // namespace strata
