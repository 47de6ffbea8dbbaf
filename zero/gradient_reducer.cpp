#include "zero/gradient_reducer.h"

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::zero {

GradientReducer::GradientReducer(std::vector<torch::Tensor> params, comm::GroupPtr group,
                                 int64_t bucket_numel)
    : params_(std::move(params)), group_(std::move(group)) {
  if (!group_) throw Error("GradientReducer: no process group");
  slots_.resize(params_.size());
  filled_.assign(params_.size(), false);
  // Reverse registration order; a bucket holds one dtype on one device.
  int64_t bucket_fill = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const bool fits = !buckets_.empty() && bucket_numel > 0 &&
                      bucket_fill + p.numel() <= bucket_numel &&
                      buckets_.back().flat.scalar_type() == p.scalar_type() &&
                      buckets_.back().flat.device() == p.device();
    if (!fits) {
      buckets_.emplace_back();
      buckets_.back().flat = torch::empty({0}, p.options());
      bucket_fill = 0;
    }
    slots_[k] = {buckets_.size() - 1, bucket_fill};
    buckets_.back().params.push_back(k);
    bucket_fill += p.numel();
    buckets_.back().flat = torch::empty({bucket_fill}, p.options());
  }
  hooks_.reserve(params_.size());
  for (size_t k = 0; k < params_.size(); ++k)
    hooks_.push_back(params_[k].register_hook([this, k](torch::Tensor grad) {
      on_gradient(k, grad);
    }));
}

GradientReducer::~GradientReducer() {
  for (size_t k = 0; k < params_.size(); ++k) params_[k].remove_hook(hooks_[k]);
}

void GradientReducer::begin_backward(bool reduce) { reducing_ = reduce; }

void GradientReducer::on_gradient(size_t param, const torch::Tensor& grad) {
  if (!reducing_) return;  // accumulating locally inside the window
  if (filled_[param])
    throw Error(fmt::format(
        "parameter {} received a second gradient in one reducing backward; call "
        "engine->backward() once per micro-step",
        param));
  const auto& slot = slots_[param];
  auto& bucket = buckets_[slot.bucket];
  auto view = bucket.flat.narrow(0, slot.offset, params_[param].numel()).view_as(params_[param]);
  // The hook runs before autograd accumulates `grad` into .grad: the bucket gets the sum.
  const auto& accumulated = params_[param].grad();
  if (accumulated.defined())
    torch::add_out(view, accumulated, grad);
  else
    view.copy_(grad);
  filled_[param] = true;
  if (++bucket.ready == bucket.params.size()) launch_ready_buckets();
}

void GradientReducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() &&
         buckets_[next_launch_].ready == buckets_[next_launch_].params.size())
    launch(buckets_[next_launch_++]);
}

void GradientReducer::launch(Bucket& bucket) {
  bucket.work = group_->all_reduce_async(bucket.flat, comm::ReduceOp::Avg);
}

void GradientReducer::finish() {
  if (!reducing_) return;
  reducing_ = false;
  // Parameters whose hook never fired (unused in this forward) contribute what they hold.
  for (auto& bucket : buckets_) {
    for (size_t k : bucket.params) {
      if (filled_[k]) continue;
      auto view = bucket.flat.narrow(0, slots_[k].offset, params_[k].numel());
      const auto& g = params_[k].grad();
      if (g.defined())
        view.copy_(g.reshape({-1}));
      else
        view.zero_();
      filled_[k] = true;
      ++bucket.ready;
    }
  }
  launch_ready_buckets();
  for (auto& bucket : buckets_) {
    bucket.work->wait();
    for (size_t k : bucket.params) {
      auto& p = params_[k];
      auto reduced = bucket.flat.narrow(0, slots_[k].offset, p.numel()).view_as(p);
      if (p.grad().defined())
        p.mutable_grad().copy_(reduced);
      else
        p.mutable_grad() = reduced.clone();
    }
    bucket.ready = 0;
    bucket.work.reset();
  }
  std::fill(filled_.begin(), filled_.end(), false);
  next_launch_ = 0;
}

}  // namespace strata::zero
