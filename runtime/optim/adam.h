// strata::optim::Adam: Adam with DeepSpeed FusedAdam's semantics, as a torch::optim::Optimizer so
// that the engine treats it and a client's LibTorch optimizer alike. Written out per parameter
// with in-place tensor ops; later issues replace the loop with a flat-buffer fused GPU kernel and
// a SIMD CPU Adam, which must keep these numbers.
//
//   adam_w_mode true:  decoupled weight decay (AdamW),
//                      p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
//   adam_w_mode false: L2 into the gradient (torch Adam), g += wd * p before the moments
//   bias_correction:   m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t); false (a
//                      DeepSpeed-only option) uses m and v as they are.
//
// State per parameter: exp_avg, exp_avg_sq, step. save()/load() go through LibTorch's own
// optimizer serialization (torch::save(optimizer, ...) / torch::load(optimizer, ...)), which
// exists with the same signature in 1.13 and 2.x; load() also restores each group's options
// (lr, betas, ...), as PyTorch's load_state_dict does and LibTorch's own optimizers do not.
// Param groups: give them at construction, each with complete AdamOptions or none (then the
// defaults); a group added later with add_param_group() gets the defaults under LibTorch 2.x.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <tuple>
#include <vector>

#include "offload/adam_math.h"

namespace strata::optim {

// Member defaults are FusedAdam's constructor defaults, for C++ callers; configs never reach
// them (the config layer fills every param and the registry passes them all).
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  // Implicit from a double: torch::optim::serialize() constructs Options(0) when loading.
  AdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(bool, bias_correction) = true;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
};

struct AdamParamState : public torch::optim::OptimizerCloneableParamState<AdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class Adam : public torch::optim::Optimizer {
 public:
  explicit Adam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                AdamOptions defaults = {});
  explicit Adam(std::vector<torch::Tensor> params, AdamOptions defaults = {});

  torch::Tensor step(LossClosure closure = nullptr) override;
  // Whether step_flat() can run: one group holding one contiguous fp32 tensor.
  bool can_step_flat() const;
  // One fused step of that tensor (its .grad is ignored): the gradient `grad` (same length,
  // fp32/bf16/fp16) is read times `grad_scale`; the new weights are also written into
  // `copy_out` when it is defined (e.g. the bf16 model copy). Same state as step().
  // With tile_numel > 0 the step runs tile by tile (one optimizer step, the same numbers) and
  // after_tile(offset, numel) is called as each tile's new weights are written, so that a caller
  // can move them on (optimizer offload: the host-to-device copy of one tile overlaps the
  // CPU step of the next, DeepSpeed's sub_group_size).
  using TileDone = std::function<void(int64_t offset, int64_t numel)>;
  void step_flat(const torch::Tensor& grad, double grad_scale, const torch::Tensor& copy_out,
                 int64_t tile_numel = 0, const TileDone& after_tile = {});
  // For a caller that keeps the flat tensor's weights and moments elsewhere (NVMe offload streams
  // them through swap files, zero/partitioned_optimizer.h): the scalars of the next step, its
  // step count advanced, without touching the tensor. The state then holds the count only (no
  // moment tensors); flat_steps() / set_flat_steps() read and restore it (checkpoints).
  AdamScalars next_flat_scalars(double grad_scale);
  // For a caller that runs the step's tiles itself (the overlapped offloaded step,
  // zero/partitioned_optimizer.h): the next step's scalars, its count advanced, and the flat
  // tensor's moments (zero at the first step). The same state as step_flat() leaves.
  struct FlatStepParts {
    AdamScalars scalars;
    torch::Tensor exp_avg, exp_avg_sq;
  };
  // advance false: the same numbers without counting the step (a speculative step, committed
  // later with set_flat_steps(flat_steps() + 1), or dropped).
  FlatStepParts begin_flat_step(double grad_scale, bool advance = true);
  int64_t flat_steps() const;
  void set_flat_steps(int64_t steps);
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  AdamParamState& state_of(const torch::Tensor& p);  // created (zero moments) on first use
  AdamParamState& count_of(const torch::Tensor& p);  // created without moments on first use
  const torch::Tensor& flat_param() const;           // after can_step_flat() was checked
  AdamScalars scalars_for(int64_t step, double grad_scale) const;
};

}  // namespace strata::optim
