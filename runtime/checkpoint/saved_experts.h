// The MoE experts of a checkpoint, per expert (runtime/engine_experts.cpp writes them): every
// rank's expert_states file holds its partition of the experts' fp32 master weights, optimizer
// state and 16-bit weights, with the partition's pieces of a global expert layout that does not
// depend on ep_size or world size: layer after layer (`expert_layout`, in module order), global
// expert after expert, the expert's parameters in order. Read back whole here, for the engine
// (re-cut to another ep_size) and for strata-ckpt (one tensor per parameter of the ep_size 1
// model).
#pragma once

#include <string>
#include <vector>

#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/tensor_file.h"
#include "zero/shard_map.h"

namespace strata::checkpoint {

class SavedExperts {
 public:
  // Reads every rank's expert_states file (the reader must have them: has_partition()).
  explicit SavedExperts(const CheckpointReader& reader);

  const json& layout() const { return layout_; }  // [{layer, experts, params: [{name, shape, stacked}]}]
  int64_t numel() const { return numel_; }
  // The saved optimizer state's type and scalars ("state.type", "state.step", ...) and the
  // names of its per-element tensors ("state.exp_avg", ...).
  const json& scalars() const { return full_->scalars; }
  std::vector<std::string> state_tensors() const;
  // Tensor `name` ("master", "weights", "state.exp_avg", ...) over the whole global layout.
  torch::Tensor assemble(const std::string& name) const;
  // The model's expert parameters, whole, from a global tensor (e.g. assemble("master")):
  // "LAYER.w1" [E, ...] for built-in experts (stacked), "LAYER.G.NAME" for one module per expert,
  // as an ep_size 1 model names them.
  std::vector<std::pair<std::string, torch::Tensor>> parameters(const torch::Tensor& global) const;

 private:
  std::string folder_;
  json layout_;
  int64_t numel_ = 0;
  std::vector<TensorFile> files_;
  const TensorFile* full_ = nullptr;  // a file that holds tensors
  zero::ShardMap map_;
};

}  // namespace strata::checkpoint
