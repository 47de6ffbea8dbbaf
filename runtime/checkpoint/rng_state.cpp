#include "runtime/checkpoint/rng_state.h"

#include <mutex>
#include <set>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "runtime/error.h"

#if STRATA_HAS_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace strata::checkpoint {
namespace {

torch::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state().clone();
}

void set_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

int cuda_devices() {
#if STRATA_HAS_CUDA
  return int(c10::cuda::device_count());
#else
  return 0;
#endif
}

at::Generator cuda_generator(int device) {
#if STRATA_HAS_CUDA
  return at::cuda::detail::getDefaultCUDAGenerator(c10::DeviceIndex(device));
#else
  throw Error(fmt::format("no CUDA generator {} in a build without CUDA", device));
#endif
}

}  // namespace

NamedTensors capture_rng_states() {
  NamedTensors out{{"cpu", state_of(at::detail::getDefaultCPUGenerator())}};
  for (int d = 0; d < cuda_devices(); ++d)
    out.emplace_back(fmt::format("cuda.{}", d), state_of(cuda_generator(d)));
  return out;
}

std::string restore_rng_states(const TensorFile& saved) {
  std::string missing;
  auto note = [&](const std::string& what) { missing += (missing.empty() ? "" : ", ") + what; };
  bool cpu = false;
  std::set<int> cuda;
  for (const auto& [name, state] : saved.tensors) {
    if (state.scalar_type() != torch::kUInt8 || state.dim() != 1)
      throw Error(fmt::format("{}: generator state '{}' is {} {}, not a byte vector", saved.path,
                              name, c10::toString(state.scalar_type()), c10::str(state.sizes())));
    try {
      if (name == "cpu") {
        set_state(at::detail::getDefaultCPUGenerator(), state);
        cpu = true;
      } else if (name.rfind("cuda.", 0) == 0) {
        const int d = std::stoi(name.substr(5));
        if (d < cuda_devices()) {
          set_state(cuda_generator(d), state);
          cuda.insert(d);
        } else {
          note(fmt::format("CUDA device {} (saved, not here)", d));
        }
      } else {
        note(fmt::format("'{}' (unknown)", name));
      }
    } catch (const c10::Error& e) {  // a state of the wrong size, or another version's
      throw Error(fmt::format("{}: generator state '{}' does not fit this LibTorch: {}", saved.path,
                              name, e.what_without_backtrace()));
    } catch (const std::logic_error&) {  // stoi
      note(fmt::format("'{}' (unknown)", name));
    }
  }
  if (!cpu) note("the CPU generator (no state saved)");
  for (int d = 0; d < cuda_devices(); ++d)
    if (!cuda.count(d)) note(fmt::format("CUDA device {} (no state saved)", d));
  return missing;
}

}  // namespace strata::checkpoint
