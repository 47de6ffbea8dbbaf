// The Gloo backend: collectives on CPU tensors over gloo::transport::tcp. Each group has its own
// Gloo context and one worker thread that runs the group's collectives in call order, so several
// can be in flight. Gloo's types stay inside gloo_backend.cpp (see the note there on symbols).
#pragma once

#include <memory>
#include <vector>

#include "comm/backend.h"
#include "comm/runtime.h"

namespace strata::comm::detail {

// The process's TCP device: on GLOO_SOCKET_IFNAME when set, on loopback when MASTER_ADDR is a
// loopback address, else on this host's name.
std::shared_ptr<void> make_gloo_device(const RankEnv& env);

class GlooBackend final : public Backend {
 public:
  // Connects the members (a collective over them, through the store under the group's prefix).
  GlooBackend(GroupInfo info, std::shared_ptr<GroupHealth> health);
  ~GlooBackend() override;  // runs what is queued, then stops the worker

  WorkPtr all_reduce(torch::Tensor t, ReduceOp op, const Call& call) override;
  WorkPtr broadcast(torch::Tensor t, int root, const Call& call) override;
  WorkPtr all_gather(torch::Tensor out, torch::Tensor in, const Call& call) override;
  WorkPtr reduce_scatter(torch::Tensor out, torch::Tensor in, ReduceOp op,
                         const Call& call) override;
  WorkPtr all_to_all(torch::Tensor out, torch::Tensor in, std::vector<int64_t> out_counts,
                     std::vector<int64_t> in_counts, const Call& call) override;
  WorkPtr barrier(const Call& call);  // barriers always run over Gloo
  // Only compares the members' calls (check.h), in queue order: for collectives on CUDA tensors.
  WorkPtr check(const Signature& sig, uint64_t seq);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The shared object that gloo::allreduce resolves to in this process (tests check that it is
// the libgloo Strata was built against, not a copy inside libtorch_cpu.so).
std::string gloo_library_path();

}  // namespace strata::comm::detail
