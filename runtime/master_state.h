// A partitioned optimizer's fp32 master weights and its inner optimizer's state as tensors, for
// checkpoints, wherever they live: on the device, in host memory (CPU offload), or in NVMe swap
// files, which are read into host memory here and written back from it (one partition's state
// in memory while a checkpoint is saved or loaded). Defined in engine_offload.cpp.
#pragma once

#include <optional>

#include <torch/torch.h>

#include "runtime/optim/state_io.h"
#include "zero/partitioned_optimizer.h"

namespace strata {

struct MasterState {
  torch::Tensor master;
  std::optional<optim::ParamState> state;  // nullopt: a state type only LibTorch's archive holds
};

MasterState export_master_state(const zero::PartitionedOptimizer& partitioned,
                                const torch::optim::Optimizer& optimizer);
// After the checkpoint's shapes were checked: the master and state into place.
void install_master_state(zero::PartitionedOptimizer& partitioned,
                          torch::optim::Optimizer& optimizer, const torch::Tensor& master,
                          const std::optional<optim::ParamState>& state);

}  // namespace strata
