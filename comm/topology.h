// Group topology for expert parallelism, laid out as DeepSpeed does (no model parallelism):
// the data-parallel group is the world; expert-parallel groups are runs of ep_size consecutive
// ranks; expert-data-parallel groups take every ep_size-th rank. World 16, ep 2:
//   EP      [0,1] [2,3] ... [14,15]
//   expert-DP [0,2,4,...,14] [1,3,5,...,15]
#pragma once

#include <memory>
#include <optional>
#include <vector>

namespace strata::comm {

class ProcessGroup;  // comm/process_group.h
using GroupPtr = std::shared_ptr<ProcessGroup>;

struct Layout {
  std::vector<int> data_parallel;                       // every rank
  std::vector<std::vector<int>> expert_parallel;        // world / ep_size groups of ep_size
  std::vector<std::vector<int>> expert_data_parallel;   // ep_size groups of world / ep_size
};

// Pure: the rank lists. ep_size must divide world_size (and num_experts when given), else
// strata::Error says which and what would.
Layout expert_layout(int world_size, int ep_size, std::optional<int> num_experts = std::nullopt);

struct ParallelGroups {
  GroupPtr data_parallel;         // the world group itself
  GroupPtr expert_parallel;       // this rank's EP group
  GroupPtr expert_data_parallel;  // this rank's expert-DP group
  int ep_size = 1;
};

// Creates this rank's groups over `world` (a collective: every rank calls it).
ParallelGroups create_expert_groups(const GroupPtr& world, int ep_size,
                                    std::optional<int> num_experts = std::nullopt);

// The groups for (world, ep_size), created on the first call and kept for the process's life
// (DeepSpeed's groups cache): the MoE layers of a model and the engine that trains them get the
// same groups. A collective on the first call for a pair (every rank calls it in the same
// order). world null (one process): ep_size must be 1 and every group is null. ep_size 1: no
// expert-parallel group (null), the expert-data-parallel group is `world`.
const ParallelGroups& expert_groups(const GroupPtr& world, int ep_size);

// Ulysses sequence parallelism, laid out as DeepSpeed does: sequence-parallel groups are runs of
// sp_size consecutive ranks (each sample's sequence is split among them); ZeRO still partitions
// over the whole world. World 8, sp 2: SP [0,1] [2,3] [4,5] [6,7]; the ranks that draw different
// samples are world / sp_size, rank r drawing sample stream r / sp_size.
std::vector<std::vector<int>> sequence_layout(int world_size, int sp_size);

// This rank's sequence-parallel group for (world, sp_size), created on the first call and kept
// for the process's life (as expert_groups): the model that shards its sequence and the engine
// that trains it get the same group. A collective on the first call for a pair. sp_size 1 or
// world null (one process; sp_size must then be 1): null.
GroupPtr sequence_group(const GroupPtr& world, int sp_size);

}  // namespace strata::comm
