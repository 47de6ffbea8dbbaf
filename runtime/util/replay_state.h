// What a recomputation must see again to compute exactly what the real forward computed: the
// random generators' state (dropout draws the same numbers, as PyTorch's preserve_rng_state and
// DeepSpeed's CudaRNGStatesTracker) and autocast's state (the same ops in the same dtypes; the
// engine's backward runs outside the forward's autocast scope).
#pragma once

#include <vector>

#include <torch/torch.h>

namespace strata::checkpointing {

class ReplayState {
 public:
  // The CPU generator's state, the CUDA generators' of `cuda_devices` (ignored in a build
  // without CUDA), and autocast's per-device state, now.
  static ReplayState capture(const std::vector<int>& cuda_devices);
  // Puts this state in place until the returned guard ends, which puts back what it found (the
  // generators continue where they were: the recomputation draws nothing from the run's
  // stream), and clears autocast's cast cache when it turned autocast on.
  class Applied;
  Applied apply() const;

 private:
  struct Generators {
    torch::Tensor cpu;
    std::vector<std::pair<int, torch::Tensor>> cuda;
  };
  struct Autocast {
    bool cpu_enabled = false, cuda_enabled = false, cache = true;
    at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  };
  static Generators capture_generators(const std::vector<int>& cuda_devices);
  static void restore_generators(const Generators& g);
  static Autocast capture_autocast();
  static void restore_autocast(const Autocast& a);

  Generators generators_;
  Autocast autocast_;
  std::vector<int> cuda_devices_;

 public:
  class Applied {
   public:
    Applied(Applied&& o) noexcept;
    Applied(const Applied&) = delete;
    Applied& operator=(const Applied&) = delete;
    Applied& operator=(Applied&&) = delete;
    ~Applied();

   private:
    friend class ReplayState;
    Applied() = default;
    bool active_ = false;
    Generators generators_;
    Autocast autocast_;
    bool turned_autocast_on_ = false;
  };
};

}  // namespace strata::checkpointing
