#include "zero/partitioned_optimizer.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "offload/cpu_adam.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "zero/host_copy.h"
#include "zero/storage.h"

namespace strata::zero {
namespace {

int64_t partitions_for(int64_t stage, const comm::GroupPtr& group) {
  return stage >= 1 && group ? group->size() : 1;
}

int64_t nbytes(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

// Stage 2 shards every gradient bucket across the ranks (one reduce-scatter per bucket); the
// other stages split the flat layout into one contiguous range per rank.
ShardMap shard_map_for(const FlatParams& flat, int64_t stage,
                       const std::vector<std::vector<size_t>>& plan) {
  if (stage < 2) return ShardMap::contiguous(flat.padded_numel(), flat.partitions());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& bucket : plan) ranges.push_back(flat.range_of(bucket));
  return ShardMap::bucketed(ranges, flat.partitions());
}

}  // namespace

PartitionedOptimizer::PartitionedOptimizer(std::vector<torch::Tensor> params,
                                           comm::GroupPtr group, PartitionedOptions options,
                                           const InnerBuilder& make_inner)
    : options_(options),
      group_(group && group->size() > 1 ? std::move(group) : nullptr),
      rank_(group_ ? group_->rank() : 0),
      flat_(std::make_unique<FlatParams>(std::move(params), partitions_for(options.stage, group_))) {
  if (options_.stage > 2) throw Error("PartitionedOptimizer: stage 3 takes the ParamUnits");
  if (options_.offload.enabled && options_.stage < 1)
    throw Error("optimizer offload partitions the optimizer: it needs ZeRO stage 1, 2 or 3");
  set_device(flat_->data());
  const auto model_dtype = flat_->data().scalar_type();
  const auto plan = GradientReducer::plan(flat_->params(), options_.reduce_bucket_numel);
  shards_ = shard_map_for(*flat_, options_.stage, plan);
  init_master(shards_.gather(flat_->data(), partition_index()), make_inner);
  if (options_.offload.enabled && options_.offload.device_share > 0 && !options_.offload.nvme)
    plan_device_share();

  GradientReducer::Options r;
  r.settle_unreached = options_.settle_unreached;
  r.bucket_numel = options_.reduce_bucket_numel;
  r.comm_dtype = options_.comm_dtype;
  r.plan = plan;
  // Summing several micro-steps in a wider dtype than the model's (fp32 under bf16/fp16).
  const bool wide = accumulates_wider_than(model_dtype);
  if (options_.stage <= 1) {
    grad_flat_ = flat_->zeros_like_data(model_dtype);
    own_local_gradients();
    if (host_gradient())  // the boundary's gradient partition, copied for the CPU step
      host_grad_ = host_buffer(shards_.partition_numel(), wide ? options_.accum_dtype : model_dtype);
    if (wide) {
      // The window's sum lives in fp32 and is all-reduced at its end (end_micro_step()); the
      // reducer's per-parameter hooks would reduce only the last micro-step's 16-bit gradient.
      grad_accum_ = flat_->zeros_like_data(options_.accum_dtype);
    } else if (group_) {
      r.mode = GradientReducer::Mode::kFull;
      reducer_ = GradientReducer::create(flat_->params(), group_, r);
    } else if (!options_.offload.enabled) {
      // One process: each gradient is written once into its place in grad_flat_ as autograd
      // delivers it (.grad is released during backward and is the view again after it).
      r.mode = GradientReducer::Mode::kFull;
      r.local_flat = grad_flat_;
      for (size_t i = 0; i < flat_->params().size(); ++i) r.flat_offsets.push_back(flat_->offset(i));
      reducer_ = GradientReducer::create(flat_->params(), nullptr, r);
      writes_local_gradients_ = true;
    }
  } else {
    r.mode = GradientReducer::Mode::kPartition;
    for (size_t i = 0; i < flat_->params().size(); ++i) r.flat_offsets.push_back(flat_->offset(i));
    r.shards = shards_;
    place_partition_gradients(r, flat_->data());
    reducer_ = GradientReducer::create(flat_->params(), group_, r);
  }
  if (options_.zenflow.enabled) {
    // ZenFlow decides itself what the device steps: the optimizer in host memory, nothing else
    // splitting it (the config reader refuses these first).
    if (!options_.offload.enabled || options_.offload.speculative || splits())
      throw Error("zero_optimization.zenflow needs the optimizer in host memory without "
                  "super_offload or ratio");
    // Its buffers now, not at the first window's end: a host or device that cannot hold them
    // fails at the start, and the first window runs at the speed of the others.
    zenflow_ = std::make_unique<ZenFlowState>();
    const int64_t n = shards_.partition_numel();
    zenflow_->sum = torch::zeros({n}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
    if (options_.zenflow.overlap) zenflow_->spare = torch::zeros_like(zenflow_->sum);
    zenflow_->host_sum = host_buffer(n, torch::kFloat);
    host_out_ = host_buffer(n, flat_->data().scalar_type());
  }
}

PartitionedOptimizer::PartitionedOptimizer(std::shared_ptr<ParamUnits> units,
                                           comm::GroupPtr group, PartitionedOptions options,
                                           const InnerBuilder& make_inner)
    : options_(options),
      group_(group && group->size() > 1 ? std::move(group) : nullptr),
      rank_(group_ ? group_->rank() : 0),
      units_(std::move(units)) {
  options_.stage = 3;
  // Tiles on the page grid of the 16-bit partition, so that a tile of new weights can go
  // straight to an NVMe swap file of the parameters (offload_param nvme, param_units.h), and of
  // the gradient swap file, which holds the communication dtype (narrower than an fp32 model's).
  if (const int64_t grain =
          int64_t(offload::kIoAlign) / std::min<int64_t>(units_->partition().element_size(),
                                                         int64_t(c10::elementSize(options_.comm_dtype)));
      options_.offload.tile_numel > 0)
    options_.offload.tile_numel = (options_.offload.tile_numel + grain - 1) / grain * grain;
  if (units_->trainable_params().empty())
    throw Error("ZeRO-3: the model has no parameter that requires a gradient");
  if (options_.offload.device_share > 0)
    throw Error("offload_optimizer.ratio below 1 keeps a share of the optimizer on the device at "
                "stages 1-2 only; at stage 3 set ratio 1");
  shards_ = units_->shards();
  // The units' device and dtype (the partition may be in host memory already: offload_param).
  const auto on_device = torch::empty({0}, units_->options());
  set_device(on_device);
  init_master(units_->partition(), make_inner);
  // As stage 2, with one bucket per unit: its gradient is reduce-scattered once the unit's
  // backward is done, and only this rank's chunk is kept. The persistent unit's parameters are
  // all over the model: its bucket is filled once its last gradient is in, not held through the
  // whole backward. reduce_bucket_size bounds the buckets' buffers alive at once, to twice
  // the larger of it and the largest unit (a unit is not split: its reduce-scatter must leave
  // each rank its shard).
  GradientReducer::Options r;
  r.settle_unreached = options_.settle_unreached;
  r.mode = GradientReducer::Mode::kPartition;
  r.comm_dtype = options_.comm_dtype;
  r.plan = units_->plan();
  r.staged_when_complete = units_->persistent_buckets();
  int64_t largest = 0;
  for (const auto& b : shards_.buckets()) largest = std::max(largest, shards_.parts() * b.chunk);
  r.max_live_numel = 2 * std::max(options_.reduce_bucket_numel, largest);
  r.flat_offsets = units_->flat_offsets();
  r.shards = shards_;
  place_partition_gradients(r, on_device);
  reducer_ = GradientReducer::create(units_->trainable_params(), group_, r);
}

void PartitionedOptimizer::init_master(const torch::Tensor& partition,
                                       const InnerBuilder& make_inner) {
  torch::NoGradGuard no_grad;
  if (options_.offload.nvme) {
    if (!options_.offload.enabled) throw Error("optimizer offload to NVMe: offload is not enabled");
    // The master goes to its swap file a tile at a time (the partition is 16-bit, and the fp32
    // copy may not fit in host memory); the moments start at zero there. master_ keeps only
    // the shape: the inner optimizer's parameter, and what checkpoints check shapes against.
    const int64_t n = partition.numel();
    offload::SwapperOptions so;
    so.tile_numel = options_.offload.tile_numel > 0 ? options_.offload.tile_numel : n;
    so.pipeline_read = options_.offload.pipeline_read;
    so.pipeline_write = options_.offload.pipeline_write;
    if (const auto& budget = options_.offload.host_budget) so.resident_numel = *budget;
    swapper_ = std::make_unique<offload::OptimizerSwapper>(*options_.offload.nvme,
                                                           options_.offload.swap_name, n, so);
    if (const auto& budget = options_.offload.host_budget) *budget -= swapper_->resident_numel();
    swapper_->write_tiles(offload::OptimizerSwapper::kMaster, [&](int64_t lo, int64_t len, float* dst) {
      const auto tile = partition.narrow(0, lo, len).to(torch::kCPU, torch::kFloat).contiguous();
      std::memcpy(dst, tile.data_ptr<float>(), static_cast<size_t>(len) * sizeof(float));
    });
    swapper_->fill_array(offload::OptimizerSwapper::kExpAvg, 0.f);
    swapper_->fill_array(offload::OptimizerSwapper::kExpAvgSq, 0.f);
    master_ = torch::empty({n}, torch::kFloat);  // never touched: no resident pages
    release_bytes(master_);
  } else {
    // Offload: in host memory, where the CPU steps it (it never crosses to the device).
    master_ = partition.to(options_.offload.enabled ? torch::Device(torch::kCPU) : device_,
                           torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
  inner_ = make_inner({master_});
  if (!inner_) throw Error("the optimizer builder returned null");
}

void PartitionedOptimizer::set_device(const torch::Tensor& params) {
  device_ = params.device();
  pin_ = options_.offload.enabled && options_.offload.pin_memory && device_.is_cuda();
}

bool PartitionedOptimizer::accumulates_wider_than(torch::ScalarType model_dtype) const {
  return options_.accumulation_steps > 1 &&
         c10::elementSize(options_.accum_dtype) > c10::elementSize(model_dtype);
}

PartitionedOptimizer::~PartitionedOptimizer() {
  if (zenflow_ && zenflow_->worker.valid()) zenflow_->worker.wait();
  // A staged copy may still read host_out_ and write `spare`: both are freed next.
  if (zenflow_ && zenflow_->staged) SideStream::synchronize(device_);
}

void PartitionedOptimizer::place_partition_gradients(GradientReducer::Options& r,
                                                     const torch::Tensor& params) {
  const int64_t n = shards_.partition_numel();
  if (!host_gradient()) {
    // On the device, summed over the window in the accumulation dtype (ZenFlow's too).
    const auto dtype = accumulates_wider_than(params.scalar_type()) ? options_.accum_dtype
                                                                    : params.scalar_type();
    r.partition_grad = grad_partition_ = torch::zeros({n}, params.options().dtype(dtype));
    return;
  }
  // Offload: each reduced chunk is copied straight into host memory, so no partition-sized
  // gradient stays on the device. The copies arrive in the communication dtype; a window of
  // several micro-steps is summed on the host in fp32, as DeepSpeed's offload does.
  if (swapper_ && options_.accumulation_steps == 1) {
    // ZeRO-Infinity: not even the gradient partition stays in host memory (gradient_swap.h).
    grad_swap_ = std::make_unique<GradientSwap>(*options_.offload.nvme,
                                                options_.offload.swap_name + "-grad", n,
                                                options_.comm_dtype);
    r.send_chunk = [swap = grad_swap_.get()](int64_t offset, const torch::Tensor& chunk) {
      swap->write(offset, chunk);
    };
  } else {
    host_grad_ = host_buffer(n, options_.comm_dtype);
    r.partition_grad = host_grad_;
    if (splits()) {  // the device share's gradient stays on the device, summed over the window
      r.device_lo = device_lo_;
      r.device_hi = device_hi_;
      r.device_partition_grad = device_grad_ = torch::zeros(
          {device_hi_ - device_lo_},
          params.options().dtype(options_.accumulation_steps > 1 ? options_.accum_dtype
                                                                 : options_.comm_dtype));
    }
    // super_offload: each chunk of the boundary's backward goes to the speculative step.
    r.on_copied = [this](int64_t offset, int64_t numel, std::function<void()> landed) {
      if (speculative_ && speculative_->pending() && boundary_)
        speculative_->arrive(offset, numel, std::move(landed));
    };
  }
  if (options_.accumulation_steps > 1)
    host_accum_ = torch::zeros({n}, torch::kFloat);
  else  // the window is one micro-step: its norm is summed on the device as buckets arrive
    r.sum_squares = device_sum_squares_ =
        torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
  r.copy_to_partition = true;
}

torch::Tensor PartitionedOptimizer::host_buffer(int64_t numel, torch::ScalarType dtype) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (pin_) {
    rlimit limit{};
    const bool capped = getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
    std::string why;
    if (capped && static_cast<uint64_t>(pinned_bytes_ + bytes) > limit.rlim_cur) {
      why = fmt::format("they would exceed the process's locked-memory limit (RLIMIT_MEMLOCK, "
                        "`ulimit -l`) of {} bytes", limit.rlim_cur);
    } else {
      // Exactly these bytes (torch's pinned allocator would lock the next power of two).
      auto t = page_locked_empty(numel, dtype, device_);
      if (t.defined()) {
        pinned_bytes_ += bytes;
        return t;
      }
      why = "the CUDA driver could not lock them (cudaHostRegister)";
    }
    pin_ = false;
    log::info("[strata] warning: optimizer offload: {} MB of page-locked host memory were asked "
              "for and {}; the offload's host buffers are pageable memory instead (correct, with "
              "slower copies). Raise the limit, or set offload_optimizer.pin_memory false to "
              "choose pageable memory.",
              bytes >> 20, why);
  }
  // 4096-aligned, so that the new weights can be written to an NVMe swap file from it.
  return page_locked_empty(numel, dtype, torch::kCPU);
}

void PartitionedOptimizer::wait_for_device() const {
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
}

const FlatParams& PartitionedOptimizer::flat() const {
  if (!flat_) throw Error("PartitionedOptimizer::flat(): stage 3 keeps no flat buffer");
  return *flat_;
}

void PartitionedOptimizer::begin_backward(bool boundary, const torch::Tensor& loss,
                                          double loss_scale) {
  if (arrival_ && arrival_->in_flight()) {
    settle();  // the forward that just ran overlapped the step
    offload_times_.forward_waits = arrival_->waits();
  }
  // A speculative step no step() took (a backward again before it): dropped.
  if (speculative_ && speculative_->pending()) speculative_->cancel();
  boundary_ = boundary;
  if (boundary && speculates()) begin_speculation(loss_scale);
  if (writes_local_gradients_) {
    // Autograd hands each gradient over (no .grad to add into); the reducer writes it in place.
    own_local_gradients();  // a .grad the program replaced since is folded in first
    for (const auto& p : flat_->params()) p.mutable_grad() = torch::Tensor();
  }
  if (reducer_) reducer_->begin_backward(boundary, loss);
}

void PartitionedOptimizer::end_backward() {
  if (!writes_local_gradients_) return;
  // Every gradient is in its place once backward returns (one process: nothing in flight); a
  // parameter backward did not reach gets its zeros now, and .grad is the view again.
  reducer_->finish();
  own_local_gradients();
}

void PartitionedOptimizer::end_micro_step() {
  settle();
  if (reducer_) reducer_->finish();
  if (writes_local_gradients_) own_local_gradients();  // .grad: the views again
  const bool speculating = speculative_ && speculative_->pending() && boundary_;
  if (offloads() && options_.stage >= 2 && host_accum_.defined() && !speculating) {
    // This micro-step's chunks have landed in host_grad_: fold them into the fp32 sum (the
    // speculative step's worker does it chunk by chunk as they land).
    torch::NoGradGuard no_grad;
    wait_for_device();
    host_accum_.add_(host_grad_);
  }
  if (accumulates_wide()) {
    // This micro-step's 16-bit gradients join the fp32 sum; .grad starts from zero again.
    torch::NoGradGuard no_grad;
    own_local_gradients();
    grad_accum_.add_(grad_flat_);
    grad_flat_.zero_();
    if (boundary_ && group_) {
      if (options_.comm_dtype == grad_accum_.scalar_type()) {
        group_->all_reduce(grad_accum_, comm::ReduceOp::Avg);
      } else {
        auto sent = grad_accum_.to(options_.comm_dtype);
        group_->all_reduce(sent, comm::ReduceOp::Avg);
        grad_accum_.copy_(sent);
      }
    }
  }
  if (speculating && options_.stage <= 1) arrive_stage1_gradient();
  boundary_ = false;
}

void PartitionedOptimizer::own_local_gradients() {
  // A program may have reset or replaced a .grad (zero_grad(set_to_none)): fold it back in.
  for (size_t i = 0; i < flat_->params().size(); ++i) {
    auto p = flat_->params()[i];
    auto view = flat_->view(grad_flat_, i);
    const auto& g = p.grad();
    if (g.defined() && g.data_ptr() == view.data_ptr()) continue;
    if (g.defined()) view.copy_(g.is_sparse() ? g.to_dense() : g);
    p.mutable_grad() = view;
  }
}

torch::Tensor PartitionedOptimizer::partition_gradient() const {
  if (host_gradient() && options_.stage >= 2) return host_accum_.defined() ? host_accum_ : host_grad_;
  if (options_.stage >= 2) return grad_partition_;
  if (accumulates_wide()) return shards_.range(grad_accum_, partition_index());
  return shards_.range(grad_flat_, partition_index());  // stage 0, 1: contiguous
}

void PartitionedOptimizer::zero_gradients() {
  if (writes_local_gradients_) {
    // The next window's first gradients overwrite their places (a parameter that gets none is
    // zeroed then): no pass over the flat buffer; .grad reads as none until that backward ends.
    reducer_->begin_window();
    for (const auto& p : flat_->params()) p.mutable_grad() = torch::Tensor();
  } else if (grad_flat_.defined()) {
    grad_flat_.zero_();
    own_local_gradients();
  }
  if (grad_accum_.defined()) grad_accum_.zero_();
  if (grad_partition_.defined()) {
    // The reducer overwrites each place with the next window's first contribution.
    if (reducer_) reducer_->begin_window();
    else grad_partition_.zero_();
  }
  if (device_grad_.defined() && reducer_) reducer_->begin_window();  // the device share's, too
  if (host_accum_.defined()) host_accum_.zero_();
  if (device_sum_squares_.defined()) device_sum_squares_.zero_();
  master_.mutable_grad() = torch::Tensor();  // the fp32 gradient lives only during a step
  grad_ = torch::Tensor();
}

GradientSummary PartitionedOptimizer::prepare(double loss_scale) {
  settle();
  torch::NoGradGuard no_grad;
  if (options_.stage <= 1 && !accumulates_wide()) own_local_gradients();
  const auto t0 = std::chrono::steady_clock::now();
  // Offload: the gradient the CPU steps with, in host memory (or its swap file: then only its
  // dtype is here, and the step reads it a tile at a time).
  if (grad_partition_.defined() && reducer_) reducer_->settle_window();
  auto gradient = partition_gradient();
  if (grad_swap_) {
    grad_swap_->flush();
    gradient = torch::empty({0}, torch::TensorOptions().dtype(grad_swap_->dtype()));
  }
  if (speculative_ && speculative_->pending()) {
    // The speculative step's worker has the pieces landed (and summed, over several micro-steps).
    speculative_->wait_gradient();
    if (options_.stage <= 1) gradient = host_grad_;
  } else if (host_gradient() && options_.stage <= 1) {
    if (splits()) {  // the CPU's part only: [0, lo) and [hi, n)
      const int64_t n = gradient.numel();
      host_grad_.narrow(0, 0, device_lo_).copy_(gradient.narrow(0, 0, device_lo_));
      host_grad_.narrow(0, device_hi_, n - device_hi_).copy_(gradient.narrow(0, device_hi_, n - device_hi_));
    } else {
      host_grad_.copy_(gradient);
    }
    gradient = host_grad_;
  } else if (host_gradient()) {
    wait_for_device();  // the last micro-step's copies (one window: they are the gradient)
  }
  const auto t1 = std::chrono::steady_clock::now();
  // A sum of squares is finite iff every element is: one reduction gives the overflow flag
  // and the norm.
  torch::Tensor sum_squares;
  const double f = options_.gradient_factor;  // 1 except for expert parameters (see options)
  if (steps_flat()) {
    // Reduced in fp32 straight from the model's dtype; the loss scale comes out on the host.
    grad_ = gradient;
    grad_scale_ = f / loss_scale;
    if (!host_gradient())
      sum_squares = at::linalg_vector_norm(grad_, 2, c10::nullopt, false, torch::kFloat)
                        .to(torch::kDouble)
                        .pow(2);
  } else {
    grad_ = gradient.to(torch::kFloat, false, /*copy=*/true);
    if (f / loss_scale != 1.0) grad_.mul_(f / loss_scale);
    if (!host_gradient()) sum_squares = grad_.pow(2).sum().to(torch::kDouble);
  }
  // Offload: the reducer summed a one-micro-step window's squares on the device (they carry the
  // loss scale); else the host tier's threaded pass over the host copy.
  double factor = steps_flat() ? grad_scale_ * grad_scale_ : 1.0;
  if (host_gradient() && device_sum_squares_.defined()) {
    sum_squares = device_sum_squares_.clone();
    factor = (f * f) / (loss_scale * loss_scale);
  } else if (host_gradient()) {
    sum_squares = torch::tensor(host_sum_squares(grad_), torch::kDouble);
    if (splits())  // the device share's gradient, where it is
      sum_squares += at::linalg_vector_norm(device_share_gradient(), 2, c10::nullopt, false, torch::kFloat)
                         .to(torch::kDouble)
                         .pow(2)
                         .cpu();
  }
  if (group_ && shards_.parts() > 1) {
    sum_squares = sum_squares.to(device_);  // the group's collectives run on the model's device
    group_->all_reduce(sum_squares, comm::ReduceOp::Sum);
  }
  if (options_.norm_group && options_.norm_group->size() > 1) {
    sum_squares = sum_squares.to(device_);
    options_.norm_group->all_reduce(sum_squares, comm::ReduceOp::Sum);
  }
  const double total = sum_squares.item<double>() * factor;  // the step's one host sync
  if (offloads()) {
    using ms = std::chrono::duration<double, std::milli>;
    offload_times_.wait_ms = ms(t1 - t0).count();
    offload_times_.norm_ms = ms(std::chrono::steady_clock::now() - t1).count();
  }
  return {!std::isfinite(total), std::sqrt(total)};
}

void PartitionedOptimizer::apply(double clip_coef) {
  torch::NoGradGuard no_grad;
  if (!grad_.defined()) throw Error("PartitionedOptimizer::apply without prepare");
  if (overlaps_step()) {
    // Gradients are zeroed when it settles.
    if (!(speculative_ && speculative_->pending() && commit_speculation(clip_coef, {})))
      start_overlapped_step(clip_coef);
    return;
  }
  const int64_t n = shards_.partition_numel();
  // The new 16-bit weights of this partition: written straight into the flat layout when the
  // partition is a range of it, else into a buffer scattered into place after the all-gather.
  // Stage 3: the units' shards are the partition, written in place; the next gathers read them.
  // Stage 3 with offload_param and the optimizer here: the shards are in host memory or a swap
  // file; they are stored from the new master after the step (ParamUnits::store_partition).
  const bool store_after = units_ && !offloads() && units_->partition_offload() != "none";
  auto mine = store_after ? torch::Tensor()
              : units_    ? units_->partition()
              : shards_.is_contiguous() ? shards_.range(flat_->data(), partition_index())
                                        : torch::empty({n}, flat_->data().options());
  if (zenflow_) {
    // Writes this partition's new weights into the flat layout itself; other ranks' come with
    // the all-gather below (stage 2 sends them from `mine`).
    apply_zenflow(clip_coef, mine);
    if (shards_.parts() == 1) {
      zero_gradients();
      return;
    }
    if (!shards_.is_contiguous()) mine.copy_(shards_.gather(flat_->data(), partition_index()));
  } else if (offloads()) {
    if (!(speculative_ && speculative_->pending() && commit_speculation(clip_coef, mine)))
      apply_offloaded(clip_coef, mine);
  } else if (flat_step_) {
    flat_step_(grad_, grad_scale_ * std::min(clip_coef, 1.0), mine, 0, {});
  } else {
    if (clip_coef < 1.0) grad_.mul_(clip_coef);
    master_.mutable_grad() = grad_;
    inner_->step();
    if (mine.defined()) mine.copy_(master_);
  }
  if (store_after) units_->store_partition(master_.view({-1}));
  const int64_t parts = shards_.parts();
  if (units_) {
    units_->refresh_persistent();
  } else if (shards_.is_contiguous()) {
    if (parts > 1) group_->all_gather(flat_->data(), mine.clone());  // input may not alias output
  } else if (parts > 1) {
    // Bucket by bucket through one buffer of the largest: the step's extra memory is one
    // bucket's 16-bit weights, not the model's.
    int64_t largest = 0;
    for (const auto& b : shards_.buckets()) largest = std::max(largest, b.chunk);
    auto gathered = torch::empty({parts * largest}, mine.options());
    for (size_t i = 0; i < shards_.buckets().size(); ++i) {
      const auto& b = shards_.buckets()[i];
      auto out = gathered.narrow(0, 0, parts * b.chunk);
      group_->all_gather(out, mine.narrow(0, b.base, b.chunk));
      shards_.scatter_bucket(out, i, flat_->data());
    }
  } else {
    shards_.scatter(mine, 0, flat_->data());
  }
  zero_gradients();
}

void PartitionedOptimizer::discard() {
  settle();
  if (speculative_ && speculative_->pending()) {  // an overflow: nothing of it is kept
    speculative_->cancel();
    ++offload_times_.redone;
  }
  torch::NoGradGuard no_grad;
  zero_gradients();
}

ModelStateBytes PartitionedOptimizer::state_bytes() const {
  ModelStateBytes bytes;
  // Each tensor once: into its field, and into host when it lives in host memory.
  auto add = [&](int64_t& field, const torch::Tensor& t) {
    field += nbytes(t);
    if (t.defined() && t.is_cpu()) bytes.host += nbytes(t);
  };
  auto add_host = [&](int64_t& field, int64_t n) { field += n, bytes.host += n; };
  if (units_) {
    bytes.params = units_->resident_bytes();
    bytes.host += units_->resident_bytes(/*host_only=*/true);
  } else {
    add(bytes.params, flat_->data());
  }
  for (const auto* g : {&grad_flat_, &grad_accum_, &grad_partition_, &host_grad_, &host_accum_})
    add(bytes.grads, *g);
  if (swapper_) {
    // master_ keeps only the shape: the master and both moments are in the swap files, but for
    // the first tiles' (offload_optimizer.max_in_cpu) in host memory.
    bytes.nvme += int64_t(offload::OptimizerSwapper::kArrays) * swapper_->swapped_numel() * 4;
    add_host(bytes.master, swapper_->resident_numel() * 4);
    add_host(bytes.optimizer, 2 * swapper_->resident_numel() * 4);
  } else {
    add(bytes.master, master_);
  }
  if (units_ && units_->partition_offload() == "nvme") bytes.nvme += nbytes(units_->partition());
  // super_offload: the second set of master and moments (the CPU's), and its new weights on
  // their way.
  if (speculative_) {
    add_host(bytes.optimizer, speculative_->shadow_bytes());
    add(bytes.optimizer, spec_out_);
  }
  // The device share: its master, moments and gradient on the device (the host keeps their shape).
  add(bytes.master, device_master_);
  add(bytes.optimizer, device_exp_avg_);
  add(bytes.optimizer, device_exp_avg_sq_);
  add(bytes.grads, device_grad_);
  if (zenflow_) {
    // The window's sums (two with overlap_step) and the selection's own master and moments.
    for (const auto* t : {&zenflow_->sum, &zenflow_->spare, &zenflow_->host_sum}) add(bytes.grads, *t);
    add(bytes.master, zenflow_->master);
    add(bytes.optimizer, zenflow_->exp_avg);
    add(bytes.optimizer, zenflow_->exp_avg_sq);
  }
  return bytes;
}

}  // namespace strata::zero
