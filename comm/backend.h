// One device kind's collectives for a group: Gloo for CPU tensors, NCCL for CUDA tensors. The
// group checks the arguments and counts the call (seq) before a backend sees it.
#pragma once

#include <optional>
#include <vector>

#include "comm/check.h"
#include "comm/process_group.h"

namespace strata::comm::detail {

// One call as a backend sees it: its number on the group (Gloo's tag, the heartbeats' count) and,
// when the members compare their calls first, what this rank passed. Only the Gloo backend is
// given `check`, and compares in its queue just before the collective; the group compares CUDA
// calls itself (a blocking Gloo exchange) before they reach NCCL.
struct Call {
  uint64_t seq = 0;
  std::optional<Signature> check;
};

// Tensors arrive contiguous and strided. Reductions get a dtype the group accepts for them;
// broadcast, all_gather and all_to_all move bytes and take any dtype.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual WorkPtr all_reduce(torch::Tensor t, ReduceOp op, const Call& call) = 0;
  virtual WorkPtr broadcast(torch::Tensor t, int root, const Call& call) = 0;
  virtual WorkPtr all_gather(torch::Tensor out, torch::Tensor in, const Call& call) = 0;
  virtual WorkPtr reduce_scatter(torch::Tensor out, torch::Tensor in, ReduceOp op,
                                 const Call& call) = 0;
  // Counts are in elements, one per member.
  virtual WorkPtr all_to_all(torch::Tensor out, torch::Tensor in, std::vector<int64_t> out_counts,
                             std::vector<int64_t> in_counts, const Call& call) = 0;
};

}  // namespace strata::comm::detail
