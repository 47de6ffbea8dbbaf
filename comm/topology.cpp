#include "comm/topology.h"

#include <map>
#include <mutex>

#include "comm/process_group.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::comm {

Layout expert_layout(int world_size, int ep_size, std::optional<int> num_experts) {
  if (world_size < 1) throw Error(fmt::format("expert layout: world size {} < 1", world_size));
  if (ep_size < 1)
    throw Error(fmt::format("expert parallel size (moe.ep_size) is {}; it must be at least 1",
                            ep_size));
  if (world_size % ep_size != 0)
    throw Error(fmt::format("expert parallel size (moe.ep_size) {} does not divide the world "
                            "size {}; pick a divisor of {}",
                            ep_size, world_size, world_size));
  if (num_experts && (*num_experts < 1 || *num_experts % ep_size != 0))
    throw Error(fmt::format("expert parallel size (moe.ep_size) {} does not divide the number "
                            "of experts {}; each EP rank must hold the same number of experts",
                            ep_size, *num_experts));
  Layout l;
  for (int r = 0; r < world_size; ++r) l.data_parallel.push_back(r);
  for (int g = 0; g < world_size / ep_size; ++g) {
    std::vector<int> ranks;
    for (int i = 0; i < ep_size; ++i) ranks.push_back(g * ep_size + i);
    l.expert_parallel.push_back(ranks);
  }
  for (int i = 0; i < ep_size; ++i) {
    std::vector<int> ranks;
    for (int r = i; r < world_size; r += ep_size) ranks.push_back(r);
    l.expert_data_parallel.push_back(ranks);
  }
  return l;
}

ParallelGroups create_expert_groups(const GroupPtr& world, int ep_size,
                                    std::optional<int> num_experts) {
  if (!world) throw Error("create_expert_groups: the world group is null");
  const Layout l = expert_layout(world->size(), ep_size, num_experts);
  ParallelGroups g;
  g.ep_size = ep_size;
  g.data_parallel = world;
  // Every rank creates every group, in the same order; non-members get nullptr.
  for (const auto& ranks : l.expert_parallel)
    if (auto pg = world->new_group(ranks)) g.expert_parallel = pg;
  for (const auto& ranks : l.expert_data_parallel)
    if (auto pg = world->new_group(ranks)) g.expert_data_parallel = pg;
  return g;
}

const ParallelGroups& expert_groups(const GroupPtr& world, int ep_size) {
  static std::mutex mutex;
  static std::map<std::pair<const ProcessGroup*, int>, ParallelGroups> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(world.get(), ep_size);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  ParallelGroups g;
  if (world && ep_size == 1) {
    // No expert parallelism: the experts' data-parallel group is the world itself (no groups of
    // one to create).
    expert_layout(world->size(), 1);
    g.data_parallel = g.expert_data_parallel = world;
    g.ep_size = 1;
  } else if (world) {
    g = create_expert_groups(world, ep_size);
  } else {
    expert_layout(1, ep_size);  // ep_size 1, else the error naming it
    g.ep_size = 1;
  }
  return cache.emplace(key, std::move(g)).first->second;
}

std::vector<std::vector<int>> sequence_layout(int world_size, int sp_size) {
  if (sp_size < 1 || world_size < 1 || world_size % sp_size != 0)
    throw Error(fmt::format("sequence_parallel_size {} does not divide the world size {}: "
                            "sequence-parallel groups are sequence_parallel_size consecutive "
                            "ranks; choose a divisor of {}",
                            sp_size, world_size, world_size));
  std::vector<std::vector<int>> groups;
  for (int g = 0; g < world_size / sp_size; ++g) {
    std::vector<int> ranks;
    for (int i = 0; i < sp_size; ++i) ranks.push_back(g * sp_size + i);
    groups.push_back(std::move(ranks));
  }
  return groups;
}

GroupPtr sequence_group(const GroupPtr& world, int sp_size) {
  static std::mutex mutex;
  static std::map<std::pair<const ProcessGroup*, int>, GroupPtr> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto groups = sequence_layout(world ? world->size() : 1, sp_size);
  if (sp_size == 1) return nullptr;
  const auto key = std::make_pair(world.get(), sp_size);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  GroupPtr mine;
  for (const auto& ranks : groups)  // every rank creates every group, in the same order
    if (auto pg = world->new_group(ranks)) mine = pg;
  return cache.emplace(key, mine).first->second;
}

}  // namespace strata::comm
