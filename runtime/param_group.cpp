#include "runtime/param_group.h"

#include "runtime/optim/state_bytes.h"

namespace strata {

PlainGroup::PlainGroup(std::string name, std::vector<torch::Tensor> params,
                       std::shared_ptr<torch::optim::Optimizer> optimizer,
                       const comm::GroupPtr& group,
                       const zero::GradientReducer::Options& reducer_options)
    : ParamGroup(std::move(name)), params_(std::move(params)), optimizer_(std::move(optimizer)) {
  if (group && group->size() > 1)
    reducer_ = zero::GradientReducer::create(params_, group, reducer_options);
}

void PlainGroup::begin_backward(bool boundary, const torch::Tensor& loss, double) {
  if (reducer_) reducer_->begin_backward(boundary, loss);
}

zero::GradientSummary PlainGroup::prepare(double, bool need_norm) {
  if (reducer_) reducer_->finish();  // gradients averaged over the data-parallel group
  // Sparse gradients (Embedding(...).sparse(true)) are stepped dense, as the reducer sends them:
  // the same numbers, and every optimizer and the clipping accept them.
  for (auto& p : params_)
    if (p.grad().defined() && p.grad().is_sparse()) p.mutable_grad() = p.grad().to_dense();
  // A trainable parameter the forward did not use steps on a zero gradient, as in DeepSpeed
  // (its engine gives such parameters zero gradients before the all-reduce) and as Strata's
  // reducer and flat partitions do: one process, several ranks and every stage then step it
  // alike (AdamW's decay, the moments), on LibTorch 1.13 (zero_grad keeps zeros) and 2.x
  // (zero_grad leaves None, which LibTorch's optimizers skip) alike.
  for (auto& p : params_)
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  zero::GradientSummary summary;
  summary.grad_norm = std::numeric_limits<double>::quiet_NaN();
  if (!need_norm) return summary;
  // One global norm over every gradient, as torch.nn.utils.clip_grad_norm_ and DeepSpeed.
  std::vector<torch::Tensor> norms;
  norms.reserve(params_.size());
  for (const auto& p : params_) norms.push_back(p.grad().detach().to(torch::kFloat).norm(2));
  summary.grad_norm = torch::stack(norms).norm(2).item<double>();
  return summary;
}

void PlainGroup::apply(double clip_coef) {
  if (clip_coef < 1.0)
    for (auto& p : params_) p.grad().mul_(clip_coef);
  optimizer_->step();
  optimizer_->zero_grad();
}

void PlainGroup::discard() { optimizer_->zero_grad(); }

zero::ModelStateBytes PlainGroup::state_bytes() const {
  zero::ModelStateBytes bytes;
  for (const auto& p : params_) {
    bytes.params += p.numel() * p.element_size();
    if (p.is_cpu()) bytes.host += 2 * p.numel() * p.element_size();  // and its gradient
  }
  bytes.grads = bytes.params;  // one gradient per parameter, same dtype
  bytes.optimizer = optim::optimizer_state_bytes(*optimizer_);
  bytes.host += optim::optimizer_state_bytes(*optimizer_, /*host_only=*/true);
  return bytes;
}

PartitionedGroup::PartitionedGroup(std::string name,
                                   std::unique_ptr<zero::PartitionedOptimizer> partitioned)
    : ParamGroup(std::move(name)), partitioned_(std::move(partitioned)) {}

zero::ModelStateBytes PartitionedGroup::state_bytes() const {
  auto bytes = partitioned_->state_bytes();
  bytes.optimizer += optim::optimizer_state_bytes(*partitioned_->inner());
  bytes.host += optim::optimizer_state_bytes(*partitioned_->inner(), /*host_only=*/true);
  return bytes;
}

UnitGroup::UnitGroup(std::string name, std::shared_ptr<zero::ParamUnits> units,
                     std::unique_ptr<zero::ParamCoordinator> coordinator,
                     std::unique_ptr<zero::PartitionedOptimizer> partitioned)
    : PartitionedGroup(std::move(name), std::move(partitioned)),
      units_(std::move(units)),
      coordinator_(std::move(coordinator)) {}

}  // namespace strata
