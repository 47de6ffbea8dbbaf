// strata::optim::SGD: stochastic gradient descent with exactly torch.optim.SGD's semantics
// (DeepSpeed's "sgd" type is torch.optim.SGD):
//   d = g + wd * p
//   buf = d on the first step, else buf = momentum * buf + (1 - dampening) * d
//   d = nesterov ? d + momentum * buf : buf            (when momentum != 0)
//   p -= lr * d
// Strata's own so that the flat-buffer kernels of later issues have a reference beside Adam.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace strata::optim {

// Member defaults are torch.optim.SGD's, for C++ callers; configs pass every value.
struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): serialize() needs it
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
};

struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class SGD : public torch::optim::Optimizer {
 public:
  explicit SGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
               SGDOptions defaults = {});
  explicit SGD(std::vector<torch::Tensor> params, SGDOptions defaults = {});

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

}  // namespace strata::optim
