// The MoE experts of a checkpoint, per expert (runtime/engine_experts.cpp writes them): every
// rank's expert_states file holds its partition of the experts' fp32 master weights, optimizer
// state and 16-bit weights, with the partition's pieces of a global expert layout that does not
// depend on ep_size or world size: layer after layer (`expert_layout`, in module order), global
// expert after expert, the expert's parameters in order. Read back by range for the engine
// (re-cut to another ep_size or world size, a window at a time), or whole for strata-ckpt (one
// tensor per parameter of the ep_size 1 model).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/saved_partitions.h"
#include "runtime/checkpoint/tensor_file.h"
#include "zero/shard_map.h"

namespace strata::checkpoint {

class SavedExperts {
 public:
  // Opens every rank's expert_states file, its checksum verified (the reader must have them:
  // has_partition()), and checks their layout and pieces.
  explicit SavedExperts(const CheckpointReader& reader);

  const json& layout() const { return layout_; }  // [{layer, experts, params: [{name, shape, stacked}]}]
  int64_t numel() const { return numel_; }
  // The saved optimizer state's type and scalars ("state.type", "state.step", ...) and the
  // names of its per-element tensors ("state.exp_avg", ...).
  const json& scalars() const { return full_->scalars(); }
  std::vector<std::string> state_tensors() const;
  // Elements [begin, begin + n) of the partition whose pieces of the global layout are `target`,
  // of tensor `name` ("master", "weights", "state.exp_avg", ...), into `dst` (its saved dtype).
  void read(const std::string& name, const std::vector<zero::ShardPiece>& target, int64_t begin,
            int64_t n, void* dst) const {
    pieces_->read(name, target, begin, n, dst);
  }
  torch::ScalarType dtype(const std::string& name) const { return full_->spec(name).dtype; }
  // Tensor `name` over the whole global layout.
  torch::Tensor assemble(const std::string& name) const;
  // The model's expert parameters, whole, from a global tensor (e.g. assemble("master")):
  // "LAYER.w1" [E, ...] for built-in experts (stacked), "LAYER.G.NAME" for one module per expert,
  // as an ep_size 1 model names them.
  std::vector<std::pair<std::string, torch::Tensor>> parameters(const torch::Tensor& global) const;

 private:
  std::string folder_;
  json layout_;
  int64_t numel_ = 0;
  std::vector<std::unique_ptr<TensorFileReader>> files_;
  const TensorFileReader* full_ = nullptr;  // a file that holds tensors
  std::unique_ptr<PieceReader> pieces_;
};

}  // namespace strata::checkpoint
