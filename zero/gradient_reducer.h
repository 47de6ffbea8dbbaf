// Data-parallel gradient averaging for stage 0: gradients are packed into flat buckets and
// all-reduced (average) over the data-parallel group while backward is still running.
//
// On the micro-step that ends an accumulation window, a hook on each parameter sees its
// gradient as autograd produces it, copies (accumulated + new) into the parameter's slot of its
// bucket, and when a bucket is full launches its all-reduce. Buckets launch strictly in bucket
// order on every rank (collectives must match across ranks), as LibTorch's DDP reducer does;
// parameters are bucketed in reverse registration order, roughly the order backward reaches
// them. finish() launches what is left (parameters that got no gradient contribute zeros),
// waits, and writes the averages back into each parameter's .grad.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"

namespace strata::zero {

class GradientReducer {
 public:
  // bucket_numel: elements per bucket (DeepSpeed's reduce_bucket_size; 0 = one per parameter).
  GradientReducer(std::vector<torch::Tensor> params, comm::GroupPtr group, int64_t bucket_numel);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Called before each backward: whether this backward ends the accumulation window.
  void begin_backward(bool reduce);
  // Completes the reduction started by the last reducing backward (a no-op otherwise).
  void finish();

  size_t bucket_count() const { return buckets_.size(); }

 private:
  struct Slot {
    size_t bucket;
    int64_t offset;
  };
  struct Bucket {
    std::vector<size_t> params;
    torch::Tensor flat;
    size_t ready = 0;  // parameters whose gradient is in `flat`
    comm::WorkPtr work;
  };

  void on_gradient(size_t param, const torch::Tensor& grad);
  void launch_ready_buckets();
  void launch(Bucket& bucket);

  std::vector<torch::Tensor> params_;
  std::vector<Slot> slots_;
  std::vector<bool> filled_;
  std::vector<Bucket> buckets_;
  std::vector<unsigned> hooks_;
  comm::GroupPtr group_;
  size_t next_launch_ = 0;
  bool reducing_ = false;
};

}  // namespace strata::zero
