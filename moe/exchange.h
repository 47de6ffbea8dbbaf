// Expert parallelism without padding: the variable-split exchange (issue 53), as Megatron-Core's
// all-to-all dispatcher and DeepEP do. Under ep_size > 1 each rank sends its kept routes' rows,
// and only those, to the ranks that hold their experts, and gets back one output row per row sent:
//
//   1. counts: the kept routes per expert [E] go through one small equal-split all_to_all, so
//      that each rank learns how many rows each peer sends each of its local experts; both
//      count vectors are then read on the host, the one device-to-host read per layer and
//      forward (NCCL, as torch's all_to_all_single, takes its split sizes on the host);
//   2. dispatch: the kept routes' rows are gathered from the tokens, sorted by (chunk, rank,
//      local expert), and sent with variable splits: exactly the routed rows, no padding rows,
//      nothing for a dropped route (over capacity) or a padding token (used_token 0);
//   3. the received rows, in (source rank, expert) blocks, are gathered into the grouped
//      product's expert-major layout (one gather, which the layout needs anyway: the rows of
//      one expert come from every rank), the experts run on exactly them (moe/experts.h
//      forward_rows), and the outputs go back by the reverse gather and exchange;
//   4. combine reads each kept route's returned row (moe/dispatch.h combine_tokens).
// Backward is the same exchanges with the splits swapped (all_to_all_variable's autograd), so it
// moves the same bytes. An activation-checkpointing recomputation runs it all again.
//
// Chunks (moe.exchange_chunks = n): the local experts are cut into n chunks (at most one per
// expert); the rows of each chunk travel in an exchange of their own, all dispatches issued
// before the first chunk's experts run and each chunk's return issued after them, so that on a
// GPU (NCCL on its own stream) a chunk's exchange overlaps another chunk's experts. The counts,
// and so the host read, are exchanged once for all chunks. Any n gives the same rows to the
// same experts: only the grouping of exchanges differs.
//
// Empty ranks (no tokens), experts no route reaches and a micro-batch routed to one rank all take
// part in every exchange with their (possibly empty) splits.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "moe/experts.h"
#include "moe/gate.h"

namespace strata::moe {

struct ExchangeResult {
  torch::Tensor rows_back;  // [sent, d]: the expert output of each row sent, in send order
  torch::Tensor position;   // [k * S]: each route's row in rows_back, `sent` for a route not sent
  int64_t sent_rows = 0;     // rows this rank sent (= its kept routes)
  int64_t received_rows = 0;  // rows its experts computed
  std::vector<int64_t> sent_to, received_from;  // rows per rank of the group (its own included)
};

// x [S, d] (the layer's tokens), the gate's routes over the group's E experts, the local experts
// (experts [rank * E_local, (rank + 1) * E_local) of `group`), `chunks` >= 1.
ExchangeResult exchange_with_experts(const torch::Tensor& x, int64_t k, const GateRoutes& routes,
                                     ExpertsImpl& experts, const comm::GroupPtr& group,
                                     int64_t chunks);

}  // namespace strata::moe
