// A partitioned optimizer's fp32 master weights and its inner optimizer's state, to and from a
// checkpoint file, wherever they live: on the device, in host memory (CPU offload), or in NVMe
// swap files, which are streamed to and from the file a tile at a time (sub_group_size
// elements), so that a model that trains only because its state is on NVMe also saves and
// resumes within its host memory. Defined in engine_offload.cpp.
#pragma once

#include <functional>
#include <string>

#include <torch/torch.h>

#include "runtime/checkpoint/tensor_stream.h"
#include "runtime/optim/state_io.h"
#include "zero/partitioned_optimizer.h"

namespace strata {

// Writes "master" and the state's tensors ("state.exp_avg", ...) into `out`, and the state's
// type and scalars into `scalars` ("state.type", "state.step", ...). Returns false, having
// written only the master, for a state only LibTorch's archive holds (the caller saves that).
bool write_master_state(const zero::PartitionedOptimizer& partitioned,
                        const torch::optim::Optimizer& optimizer, checkpoint::TensorFileWriter& out,
                        json& scalars);

// The saved state without its arrays: type, scalars, and its tensors' names, each tensor
// shaped like `master` but holding no bytes of its own (check_param_state reads shapes only).
optim::ParamState saved_state_header(const json& scalars, const std::vector<std::string>& names,
                                     const torch::Tensor& master);

// Where install_master_state reads this rank's partition: fill(name, offset, n, dst) writes
// elements [offset, offset + n) of saved array `name` ("master", "state.exp_avg", ...) as fp32.
using PartitionSource =
    std::function<void(const std::string& name, int64_t offset, int64_t n, float* dst)>;
// After the checkpoint was verified and `header` checked (check_param_state): the master and
// the state into place; into the swap files a tile at a time.
void install_master_state(zero::PartitionedOptimizer& partitioned,
                          torch::optim::Optimizer& optimizer, const PartitionSource& source,
                          const optim::ParamState& header);

}  // namespace strata
