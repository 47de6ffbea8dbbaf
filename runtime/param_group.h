// How one group of parameters is held, reduced, stepped and measured. The engine trains its
// parameters as a list of these (runtime/engine.cpp walks it in backward, step, clipping and
// the memory tally): the dense parameters over the data-parallel group and, with MoE, the
// experts over their expert-data-parallel group, built the same way (runtime/engine_groups.cpp).
// One implementation per ZeRO family, as FSDP2 keeps its per-module state behind one interface:
//   PlainGroup        fp32 stage 0: the optimizer steps the module's own tensors; with several
//                     ranks their gradients are averaged in buckets (zero/gradient_reducer.h)
//   PartitionedGroup  mixed precision and stages 1-2: fp32 master partitions over a flat buffer
//                     of the 16-bit weights (zero/partitioned_optimizer.h), optimizer offload
//   UnitGroup         stage 3: the same optimizer over units that a coordinator gathers on use
//                     and releases after (zero/param_units.h, zero/param_coordinator.h), with
//                     offload_param
// The step is two calls on every group, so that one decision covers them all: prepare() (the
// reduced gradients' norm and overflow), then apply(clip coefficient) or discard().
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "zero/gradient_reducer.h"
#include "zero/param_coordinator.h"
#include "zero/param_units.h"
#include "zero/partitioned_optimizer.h"

namespace strata {
namespace checkpoint {
class CheckpointWriter;
class CheckpointReader;
}  // namespace checkpoint

// A group's part of a checkpoint: its master weights and optimizer state (the dense group's in
// optim_states, the experts' in expert_states, each laid out so that another world size, stage
// or ep_size can load it). read() checks everything and changes nothing; what it returns does
// the change: `first` what can still fail (LibTorch's optimizer archive is checked only by
// loading it), `install` the rest, after the engine's other state.
struct GroupInstall {
  std::function<void()> first, install;
};
struct GroupStateFiles {
  std::function<void(checkpoint::CheckpointWriter&)> save;
  std::function<GroupInstall(const checkpoint::CheckpointReader&, int64_t saved_micro_steps)> read;
};

class ParamGroup {
 public:
  explicit ParamGroup(std::string name) : name_(std::move(name)) {}
  virtual ~ParamGroup() = default;
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  // "dense" or "experts".
  const std::string& name() const { return name_; }

  // Around each micro-step's backward (boundary: the accumulation window's last micro-step;
  // loss: what backward starts from, whose graph tells the parameters it will not reach).
  // loss_scale: the factor backward's gradients carry (fp16's loss scale).
  virtual void begin_backward(bool boundary, const torch::Tensor& loss, double loss_scale) = 0;
  virtual void end_backward() {}  // right after it, before the program sees .grad
  virtual void end_micro_step() = 0;
  // At the boundary: the gradients reduced, whether any overflowed, and their norm (of the
  // unscaled gradient). `need_norm` false lets the plain fp32 path skip it (the norm is NaN then).
  virtual zero::GradientSummary prepare(double loss_scale, bool need_norm) = 0;
  // The prepared step, with the gradients multiplied by min(clip_coef, 1); or skipped.
  virtual void apply(double clip_coef) = 0;
  virtual void discard() = 0;
  // Waits for a step still running (an offloaded step overlapping the next forward).
  virtual void settle() {}

  virtual const std::shared_ptr<torch::optim::Optimizer>& optimizer() const = 0;
  // This rank's bytes of the group's parameters, gradients, master weights and optimizer state.
  virtual zero::ModelStateBytes state_bytes() const = 0;
  // Its gradient reducer (bucket counters), when one reduces its gradients.
  virtual const zero::GradientReducer* reducer() const = 0;
  // Mixed precision / ZeRO: the partitioned optimizer; stage 3: also its units and coordinator.
  virtual zero::PartitionedOptimizer* partitioned() const { return nullptr; }
  virtual zero::ParamUnits* units() const { return nullptr; }
  virtual zero::ParamCoordinator* coordinator() const { return nullptr; }

  // Checkpoints: how this group's state is saved and read (given by the engine, which knows
  // the module's names and the expert layout).
  const GroupStateFiles& state_files() const { return state_files_; }
  void set_state_files(GroupStateFiles files) { state_files_ = std::move(files); }

 private:
  std::string name_;
  GroupStateFiles state_files_;
};

// fp32 stage 0: the module's tensors are what the optimizer steps.
class PlainGroup final : public ParamGroup {
 public:
  // `reducer_options` is used with a group of several ranks.
  PlainGroup(std::string name, std::vector<torch::Tensor> params,
             std::shared_ptr<torch::optim::Optimizer> optimizer, const comm::GroupPtr& group,
             const zero::GradientReducer::Options& reducer_options);
  void begin_backward(bool boundary, const torch::Tensor& loss, double loss_scale) override;
  void end_micro_step() override {}
  zero::GradientSummary prepare(double loss_scale, bool need_norm) override;
  void apply(double clip_coef) override;
  void discard() override;
  const std::shared_ptr<torch::optim::Optimizer>& optimizer() const override { return optimizer_; }
  zero::ModelStateBytes state_bytes() const override;
  const zero::GradientReducer* reducer() const override { return reducer_.get(); }

 private:
  std::vector<torch::Tensor> params_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<zero::GradientReducer> reducer_;
};

// Mixed precision and stages 1-2 (and, as UnitGroup, stage 3): the partitioned optimizer.
class PartitionedGroup : public ParamGroup {
 public:
  PartitionedGroup(std::string name, std::unique_ptr<zero::PartitionedOptimizer> partitioned);
  void begin_backward(bool boundary, const torch::Tensor& loss, double loss_scale) override {
    partitioned_->begin_backward(boundary, loss, loss_scale);
  }
  void end_backward() override { partitioned_->end_backward(); }
  void end_micro_step() override { partitioned_->end_micro_step(); }
  zero::GradientSummary prepare(double loss_scale, bool) override {
    return partitioned_->prepare(loss_scale);
  }
  void apply(double clip_coef) override { partitioned_->apply(clip_coef); }
  void discard() override { partitioned_->discard(); }
  void settle() override { partitioned_->settle(); }
  const std::shared_ptr<torch::optim::Optimizer>& optimizer() const override {
    return partitioned_->inner();
  }
  zero::ModelStateBytes state_bytes() const override;
  const zero::GradientReducer* reducer() const override { return partitioned_->reducer(); }
  zero::PartitionedOptimizer* partitioned() const override { return partitioned_.get(); }

 private:
  std::unique_ptr<zero::PartitionedOptimizer> partitioned_;
};

// Stage 3: the parameters live as shards of units, gathered on use by the coordinator.
class UnitGroup final : public PartitionedGroup {
 public:
  UnitGroup(std::string name, std::shared_ptr<zero::ParamUnits> units,
            std::unique_ptr<zero::ParamCoordinator> coordinator,
            std::unique_ptr<zero::PartitionedOptimizer> partitioned);
  zero::ParamUnits* units() const override { return units_.get(); }
  zero::ParamCoordinator* coordinator() const override { return coordinator_.get(); }

 private:
  std::shared_ptr<zero::ParamUnits> units_;
  std::unique_ptr<zero::ParamCoordinator> coordinator_;
};

}  // namespace strata
