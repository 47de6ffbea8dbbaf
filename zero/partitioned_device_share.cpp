// PartitionedOptimizer's device share (offload_optimizer.ratio < 1, stages 1-2; SuperOffload's
// split, DeepSpeed's Twin-Flow): the buckets backward reaches last hold the first layers, whose
// weights the next forward needs first. Their share of the partition keeps its fp32 master and
// Adam moments on the model's device, its gradient stays there (the reducer sums it in a device
// buffer instead of copying it out), and it is stepped by the fused device Adam as soon as the
// step's scalars are known, while the CPU steps the rest. The host master and moments keep the
// whole partition's shape (checkpoints read and write them as without a share): the device share
// is copied into them before they are read (store_device_share) and back after they are written.
#include <algorithm>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"
#include "zero/host_copy.h"
#include "zero/partitioned_optimizer.h"

namespace strata::zero {

void PartitionedOptimizer::plan_device_share() {
  const int64_t n = shards_.partition_numel();
  const auto target = static_cast<int64_t>(options_.offload.device_share * double(n));
  if (target <= 0) return;
  if (shards_.is_contiguous()) {
    // Stage 1: the partition is a range of the flat layout; its lowest elements come first.
    device_lo_ = 0;
    device_hi_ = std::min(n, target);
  } else {
    // Stage 2: whole buckets, lowest in the flat layout first (laid out last parameter first,
    // they are the partition's last chunks).
    auto buckets = shards_.buckets();
    std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.lo < b.lo; });
    int64_t sum = 0, lo = n, hi = 0;
    for (const auto& b : buckets) {
      if (sum + b.chunk > target) break;
      sum += b.chunk;
      lo = std::min(lo, b.base);
      hi = std::max(hi, b.base + b.chunk);
    }
    if (sum == 0) return;  // the first bucket alone is larger than the share
    if (hi - lo != sum)
      throw Error("offload_optimizer.ratio: the buckets kept on the device are not one range of "
                  "the partition");
    device_lo_ = lo;
    device_hi_ = hi;
  }
  const int64_t m = device_hi_ - device_lo_;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device_);
  device_master_ = master_.narrow(0, device_lo_, m).to(f32, /*non_blocking=*/false, /*copy=*/true);
  device_exp_avg_ = torch::zeros({m}, f32);
  device_exp_avg_sq_ = torch::zeros({m}, f32);
}

torch::Tensor PartitionedOptimizer::device_share_gradient() const {
  if (device_grad_.defined()) return device_grad_;  // stage 2: the reducer sums it there
  return partition_gradient().narrow(0, device_lo_, device_hi_ - device_lo_);  // stage 1
}

double PartitionedOptimizer::host_sum_squares(const torch::Tensor& grad) const {
  const auto* g = static_cast<const char*>(grad.data_ptr());
  const int64_t size = grad.element_size(), n = grad.numel();
  const int threads = at::get_num_threads();
  // The device share's place in the host buffer is not its gradient: left out.
  return offload::cpu_sum_squares(g, host_float(grad), splits() ? device_lo_ : n, threads) +
         (splits() ? offload::cpu_sum_squares(g + device_hi_ * size, host_float(grad),
                                              n - device_hi_, threads)
                   : 0.0);
}

void PartitionedOptimizer::step_device_share(const optim::AdamScalars& s, const torch::Tensor& mine) {
  if (!splits()) return;
  if (!device_step_)
    throw Error("offload_optimizer.ratio: no device step was given (use_device_step); only "
                "Strata's Adam/AdamW keep a share of the optimizer on the device");
  const int64_t m = device_hi_ - device_lo_;
  // Where the new weights go: the partition's device buffer, or (one partition) the flat buffer:
  // a range of it at stage 1, each bucket's place at stage 2.
  const bool scatter = !mine.defined() && !shards_.is_contiguous();
  torch::Tensor out;
  if (mine.defined()) {
    out = mine.narrow(0, device_lo_, m);
  } else if (!scatter) {
    out = shards_.range(flat_->data(), partition_index()).narrow(0, device_lo_, m);
  } else {
    if (!device_out_.defined()) device_out_ = torch::empty({m}, flat_->data().options());
    out = device_out_;
  }
  device_step_(device_master_, device_exp_avg_, device_exp_avg_sq_, device_share_gradient(), out, s);
  if (scatter)
    for (const auto& t : step_items())
      if (in_device_share(t.part))
        flat_->data().narrow(0, t.flat, t.n).copy_(device_out_.narrow(0, t.part - device_lo_, t.n));
}

void PartitionedOptimizer::store_device_share() {
  if (zenflow_ && overlapped_step_) {
    torch::NoGradGuard no_grad;
    settle_zenflow();  // an overlapped CPU update writes the host arrays
    zenflow_hand_back(overlapped_step_(1.0, /*advance=*/false));
  }
  if (!splits() || !overlapped_step_) return;
  torch::NoGradGuard no_grad;
  const int64_t m = device_hi_ - device_lo_;
  const auto adam = overlapped_step_(1.0, /*advance=*/false);  // the host state, unchanged
  master_.narrow(0, device_lo_, m).copy_(device_master_);
  adam.exp_avg.narrow(0, device_lo_, m).copy_(device_exp_avg_);
  adam.exp_avg_sq.narrow(0, device_lo_, m).copy_(device_exp_avg_sq_);
}

void PartitionedOptimizer::load_device_share() {
  if (zenflow_ && overlapped_step_) {
    torch::NoGradGuard no_grad;
    zenflow_take(overlapped_step_(1.0, /*advance=*/false));
  }
  if (!splits() || !overlapped_step_) return;
  torch::NoGradGuard no_grad;
  const int64_t m = device_hi_ - device_lo_;
  const auto adam = overlapped_step_(1.0, /*advance=*/false);
  device_master_.copy_(master_.narrow(0, device_lo_, m));
  device_exp_avg_.copy_(adam.exp_avg.narrow(0, device_lo_, m));
  device_exp_avg_sq_.copy_(adam.exp_avg_sq.narrow(0, device_lo_, m));
}

}  // namespace strata::zero
