// One device kind's collectives for a group: Gloo for CPU tensors, NCCL for CUDA tensors. The
// group checks the arguments and counts the call (seq) before a backend sees it.
#pragma once

#include <vector>

#include "comm/process_group.h"

namespace strata::comm::detail {

// Tensors arrive contiguous and strided. Reductions get a dtype the group accepts for them;
// broadcast, all_gather and all_to_all move bytes and take any dtype.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual WorkPtr all_reduce(torch::Tensor t, ReduceOp op, uint64_t seq) = 0;
  virtual WorkPtr broadcast(torch::Tensor t, int root, uint64_t seq) = 0;
  virtual WorkPtr all_gather(torch::Tensor out, torch::Tensor in, uint64_t seq) = 0;
  virtual WorkPtr reduce_scatter(torch::Tensor out, torch::Tensor in, ReduceOp op,
                                 uint64_t seq) = 0;
  // Counts are in elements, one per member.
  virtual WorkPtr all_to_all(torch::Tensor out, torch::Tensor in, std::vector<int64_t> out_counts,
                             std::vector<int64_t> in_counts, uint64_t seq) = 0;
};

}  // namespace strata::comm::detail
