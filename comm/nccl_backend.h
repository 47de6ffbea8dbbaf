// The NCCL backend (built only with NCCL): collectives on CUDA tensors, on one CUDA stream of
// the group's own, ordered after the caller's current stream with CUDA events.
#pragma once

#include <memory>

#include "comm/backend.h"
#include "comm/runtime.h"

namespace strata::comm::detail {

// Creates the group's communicator on `device`: a collective over the group's members (the
// NCCL unique id travels through the rendezvous store). `coll` names the call that needed it.
std::unique_ptr<Backend> make_nccl_backend(const GroupInfo& info,
                                           std::shared_ptr<GroupHealth> health,
                                           const torch::Device& device, const char* coll);

}  // namespace strata::comm::detail
