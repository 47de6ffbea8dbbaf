// Counting host synchronisations on CUDA: LibTorch's sync debug mode (L_WARN) makes every call
// that waits for the device emit a warning; a warning handler counts them. For the GPU tests
// that hold a path to a budget of host syncs (tests built with STRATA_TEST_HAS_CUDA).
#pragma once

#if STRATA_TEST_HAS_CUDA
#include <string>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

namespace strata::test_support {

class SyncCounter : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchroniz") != std::string::npos) ++count;
  }
  int count = 0;
};

// Runs `work` with sync debug mode on; the number of host syncs it made.
template <typename Work>
int count_syncs(Work&& work) {
  torch::cuda::synchronize();
  SyncCounter counter;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&counter);
    auto& state = c10::cuda::warning_state();
    const auto before = state.get_sync_debug_mode();
    state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    try {
      work();
    } catch (...) {
      state.set_sync_debug_mode(before);
      throw;
    }
    state.set_sync_debug_mode(before);
  }
  torch::cuda::synchronize();
  return counter.count;
}

}  // namespace strata::test_support
#endif
