#include "runtime/util/replay_state.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>

#include "runtime/compat.h"

#if STRATA_HAS_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace strata::checkpointing {
namespace {

torch::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

#if STRATA_HAS_CUDA
at::Generator cuda_generator(int device) {
  return at::cuda::detail::getDefaultCUDAGenerator(c10::DeviceIndex(device));
}
#endif

}  // namespace

ReplayState::Generators ReplayState::capture_generators(const std::vector<int>& cuda_devices) {
  Generators g;
  g.cpu = state_of(at::detail::getDefaultCPUGenerator());
#if STRATA_HAS_CUDA
  for (int d : cuda_devices) g.cuda.emplace_back(d, state_of(cuda_generator(d)));
#else
  (void)cuda_devices;
#endif
  return g;
}

void ReplayState::restore_generators(const Generators& g) {
  set_state(at::detail::getDefaultCPUGenerator(), g.cpu);
#if STRATA_HAS_CUDA
  for (const auto& [d, state] : g.cuda) set_state(cuda_generator(d), state);
#endif
}

ReplayState::Autocast ReplayState::capture_autocast() {
  Autocast a;
  a.cpu_enabled = compat::autocast_enabled(c10::DeviceType::CPU);
  a.cuda_enabled = compat::autocast_enabled(c10::DeviceType::CUDA);
  a.cpu_dtype = compat::autocast_dtype(c10::DeviceType::CPU);
  a.cuda_dtype = compat::autocast_dtype(c10::DeviceType::CUDA);
  a.cache = at::autocast::is_autocast_cache_enabled();
  return a;
}

void ReplayState::restore_autocast(const Autocast& a) {
  compat::set_autocast_enabled(c10::DeviceType::CPU, a.cpu_enabled);
  compat::set_autocast_enabled(c10::DeviceType::CUDA, a.cuda_enabled);
  compat::set_autocast_dtype(c10::DeviceType::CPU, a.cpu_dtype);
  compat::set_autocast_dtype(c10::DeviceType::CUDA, a.cuda_dtype);
  at::autocast::set_autocast_cache_enabled(a.cache);
}

ReplayState ReplayState::capture(const std::vector<int>& cuda_devices) {
  ReplayState s;
  s.cuda_devices_ = cuda_devices;
  s.generators_ = capture_generators(cuda_devices);
  s.autocast_ = capture_autocast();
  return s;
}

ReplayState::Applied ReplayState::apply() const {
  Applied a;
  a.generators_ = capture_generators(cuda_devices_);
  a.autocast_ = capture_autocast();
  a.turned_autocast_on_ = (autocast_.cpu_enabled && !a.autocast_.cpu_enabled) ||
                          (autocast_.cuda_enabled && !a.autocast_.cuda_enabled);
  restore_generators(generators_);
  restore_autocast(autocast_);
  a.active_ = true;
  return a;
}

ReplayState::Applied::Applied(Applied&& o) noexcept
    : active_(o.active_),
      generators_(std::move(o.generators_)),
      autocast_(o.autocast_),
      turned_autocast_on_(o.turned_autocast_on_) {
  o.active_ = false;
}

ReplayState::Applied::~Applied() {
  if (!active_) return;
  // The weights change before the next forward: casts cached by the recomputation must go, as
  // torch.autocast's exit clears them.
  if (turned_autocast_on_) at::autocast::clear_cache();
  restore_generators(generators_);
  restore_autocast(autocast_);
}

}  // namespace strata::checkpointing
