// Bytes held by an optimizer's per-parameter state, for the engine's model-state accounting.
// Knows Strata's Adam and SGD and LibTorch's Adam, AdamW and SGD; other optimizers count 0.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace strata::optim {

// host_only: only the state in host memory (an offloaded optimizer's).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer, bool host_only = false);

}  // namespace strata::optim
