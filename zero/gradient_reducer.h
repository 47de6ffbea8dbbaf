// Data-parallel gradient averaging in flat buckets, launched while backward is still running.
//
// A hook after each parameter's gradient accumulation (the AccumulateGrad node's post hook, as
// LibTorch's DDP reducer uses) copies the gradient into its bucket, in the communication dtype;
// a full bucket's collective is launched at once. Buckets launch strictly in bucket order on
// every rank, since collectives must match across ranks. That order is the plan's (parameters
// bucketed in reverse registration order, roughly the order backward reaches them: plan()) until
// the first backward that reduces over a group has run; from then on it is the order in which
// rank 0's buckets completed in that backward, broadcast at its end, so that every rank launches
// in the same order and each bucket goes as soon as backward is done with it (ZeRO-3's
// persistent unit, whose parameters are spread over the whole model, completes last though it
// is first in the plan: in plan order it held every other bucket back). finish() launches what is
// left (a parameter that got no gradient contributes what its .grad holds, or zeros), waits, and
// delivers:
//   - Mode::kFull (stage 0, 1): only on the micro-step that ends the accumulation window; one
//     all-reduce (average) per bucket, written back into each parameter's .grad.
//   - Mode::kPartition (stage 2): on every micro-step; each .grad is freed as soon as it is in
//     its bucket. A bucket holds its parameters in flat order and is sharded across the ranks as
//     the ShardMap says (shard_map.h, bucketed()): one reduce-scatter (average) leaves this rank's
//     chunk, which is added into the partition's gradient accumulator. No full-size gradient
//     outlives its bucket, and each bucket moves half the bytes of an all-reduce.
// Parameters backward will not reach (a streamed expert unit no token reached): with
// Options::settle_unreached, over a group, begin_backward walks the autograd graph from the loss
// (DDP's find_unused_parameters) and such a parameter contributes what its .grad holds, or
// zeros, as soon as the gradients its bucket does get are in, or, for a bucket backward reaches
// not at all, when its turn to launch comes. Without that walk the launches stopped at such a
// bucket until finish(), every later bucket's buffer piled up past max_live_numel, and nothing
// overlapped the rest of backward. In the backward that teaches the launch order, such a bucket
// takes the place after the bucket that came before it in the old order.
// A bucket's buffer exists from its first gradient until it is delivered; buckets are delivered
// (the compute stream waits for their collective) as soon as kInFlight later ones have launched,
// and, with Options::max_live_numel, whenever a new bucket's buffer would take the buffers held
// past it: a backward holds a few buckets' buffers at a time (DeepSpeed's double-buffered IPG
// bucket), not a second copy of every gradient.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "zero/shard_map.h"

namespace strata::zero {

class GradientReducer : public std::enable_shared_from_this<GradientReducer> {
 public:
  enum class Mode { kFull, kPartition };
  struct Options {
    Mode mode = Mode::kFull;
    int64_t bucket_numel = 0;  // DeepSpeed's reduce_bucket_size; 0 = one bucket per parameter
    torch::ScalarType comm_dtype = torch::kFloat;
    // kPartition: the buckets (plan() of the same parameters and bucket_numel), each
    // parameter's offset in the flat layout, the bucketed ShardMap of those buckets (bucket b is
    // shards.buckets()[b]), and this rank's gradient accumulator (shards.partition_numel()).
    std::vector<std::vector<size_t>> plan;
    std::vector<int64_t> flat_offsets;
    ShardMap shards;
    torch::Tensor partition_grad;
    // kFull in one process (stages 0 and 1, no group): the flat gradient (FlatParams' layout,
    // flat_offsets given) that each parameter's gradient is written into as autograd delivers
    // it: copied on a window's first micro-step, added after, and .grad released. Without it,
    // autograd adds each gradient into its view of a zeroed flat buffer: the buffer zeroed,
    // read and written again, where this writes it once.
    torch::Tensor local_flat;
    // kPartition with optimizer offload: partition_grad is a host buffer (pinned on GPUs) that
    // each reduced chunk is copied into, asynchronously, instead of being added to; the owner
    // sums micro-steps on the host once the copies are done.
    bool copy_to_partition = false;
    // With copy_to_partition: partition elements [device_lo, device_hi) are not copied to host
    // memory but summed on the device into device_partition_grad (hi - lo elements), as without
    // copy_to_partition (offload_optimizer.ratio: that share of the optimizer stays on the
    // device). Whole buckets only.
    int64_t device_lo = 0, device_hi = 0;
    torch::Tensor device_partition_grad;
    // With copy_to_partition: a device scalar (double) each reduced chunk's sum of squares is
    // added to, so that a one-micro-step window's gradient norm needs no pass on the host.
    torch::Tensor sum_squares;
    // With copy_to_partition into partition_grad: told of each chunk as its copy is queued, with
    // a wait for that copy (empty: done already), so that the host may use it before the step
    // (the speculative CPU step, zero/speculative_step.h).
    std::function<void(int64_t offset, int64_t numel, std::function<void()> landed)> on_copied;
    // With copy_to_partition: where each reduced chunk goes instead of partition_grad (then
    // undefined), given its offset in the partition (ZeRO-Infinity's gradient swap file).
    std::function<void(int64_t offset, const torch::Tensor& chunk)> send_chunk;
    // At most this many elements of bucket buffers at once (0: no bound but kInFlight): before
    // a bucket's buffer is allocated, launched buckets are delivered, oldest first, until it fits.
    int64_t max_live_numel = 0;
    // Buckets (by plan index) whose parameters' gradients arrive spread over the whole backward
    // (ZeRO-3's persistent unit): they keep their .grad until the last one has arrived and are
    // staged then, so that their buffer does not live through the whole backward.
    std::vector<bool> staged_when_complete;
    // Walk the graph from the loss and settle the buckets backward does not reach at their turn
    // (above). Only where every rank of the group leaves the same parameters unreached (the MoE
    // experts: the units no token reaches are agreed over the group): ranks that reach different
    // ones would interleave those reductions with their other collectives differently (at stage
    // 3, with the gathers), where otherwise the step's check names the modules they ran.
    bool settle_unreached = false;
  };

  // Parameter indices per bucket: reverse registration order, at most bucket_numel elements per
  // bucket (a larger parameter gets a bucket of its own), one device per bucket.
  static std::vector<std::vector<size_t>> plan(const std::vector<torch::Tensor>& params,
                                               int64_t bucket_numel);

  // The group may be null (one process): gradients still move into place, nothing is sent.
  static std::shared_ptr<GradientReducer> create(std::vector<torch::Tensor> params,
                                                 comm::GroupPtr group, Options options);

  // Called before each backward with whether it ends the accumulation window, and the tensor
  // backward starts from (undefined: every parameter is taken to receive a gradient).
  void begin_backward(bool boundary, const torch::Tensor& loss = {});
  // Called after each backward (every micro-step); a no-op when that backward reduced nothing.
  void finish();
  // kPartition with partition_grad: a new accumulation window. Each place's first contribution
  // in it overwrites the place instead of being added to it, so the accumulator needs no zeroing
  // pass between steps (a full pass over the partition's gradient, each step).
  void begin_window();
  // Zeroes the places no contribution has reached since begin_window() (a step taken without a
  // backward reads zeros, not the last window's gradients). After finish(), every place has had
  // one, so this costs nothing then.
  void settle_window();
  size_t bucket_count() const { return buckets_.size(); }
  // Elements of bucket buffers held now, and the most held at once since creation.
  int64_t live_bucket_numel() const { return live_numel_; }
  int64_t peak_bucket_numel() const { return peak_numel_; }
  // The bound on them (Options::max_live_numel; 0: none but kInFlight), and the bytes of one
  // element of a bucket (the communication dtype).
  int64_t max_live_numel() const { return options_.max_live_numel; }
  int64_t element_size() const { return int64_t(c10::elementSize(options_.comm_dtype)); }
  // Collectives launched while some parameter's gradient was still to come, in the last
  // reducing backward: those that overlap backward.
  size_t launched_during_backward() const { return launched_during_backward_; }
  // The order buckets launch in (plan indices; the learnt one after the first reducing backward).
  const std::vector<size_t>& launch_order() const { return launch_order_; }

 private:
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> slots;  // element offset of each parameter in `flat`
    torch::TensorOptions options;  // device and communication dtype
    int64_t numel = 0;   // what is sent (kPartition: parts x chunk)
    int64_t filled = 0;  // elements the parameters fill; the rest is zero padding
    int64_t out_offset = 0, out_numel = 0;  // the reduced result within `flat`
    torch::Tensor flat;          // allocated by the first gradient, freed when delivered
    torch::Tensor accumulator;   // kPartition: its place in the partition's gradient
    int64_t partition_offset = 0;  // kPartition: where that place starts
    size_t ready = 0;    // parameters staged into the buffer
    size_t arrived = 0;  // parameters whose gradient arrived (staged, or waiting if late)
    size_t expected = 0;  // parameters this backward reaches (begin_backward's walk)
    bool staged_when_complete = false;  // Options::staged_when_complete
    bool fresh = true;  // kPartition: the accumulator's place holds no contribution of this window
    bool on_device = false;  // copy_to_partition, but summed on the device (Options::device_lo)
    comm::WorkPtr work;
  };
  static constexpr size_t kInFlight = 2;  // launched buckets not yet delivered, at most

  GradientReducer(std::vector<torch::Tensor> params, comm::GroupPtr group, Options options);
  void attach_hooks();
  void on_gradient(size_t param);
  void arrive(size_t param);  // its gradient is final for this backward
  // Every gradient of the bucket this backward brings is in: its other parameters (unreached,
  // or staged_when_complete) are staged now.
  void complete(size_t bucket);
  // Counts, per bucket, the parameters a path from `loss` reaches (Bucket::expected).
  void find_unreached(const torch::Tensor& loss);
  void stage(size_t param);  // copies the parameter's .grad (or zeros) into its bucket
  void launch_ready_buckets();
  void deliver(Bucket& bucket);
  void make_room(int64_t numel);  // delivers launched buckets until `numel` more fits
  void learn_launch_order();

  std::vector<torch::Tensor> params_;
  comm::GroupPtr group_;
  Options options_;
  std::vector<std::pair<size_t, size_t>> where_;  // param -> (bucket, index in bucket)
  std::vector<bool> arrived_;
  std::vector<bool> fresh_;  // accumulates_in_place_: the param's place holds nothing of this window
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keeps the hooks alive
  // Positions in launch_order_: the next bucket to launch, the next launched one to deliver.
  size_t next_launch_ = 0, next_deliver_ = 0;
  std::vector<size_t> launch_order_;
  std::vector<size_t> completed_;  // this backward's buckets in the order they completed
  bool order_learnt_ = false;
  size_t launched_during_backward_ = 0;
  size_t arrivals_ = 0;  // parameters arrived in this backward (through their hooks)
  size_t expected_arrivals_ = 0;  // parameters this backward reaches
  int64_t live_numel_ = 0, peak_numel_ = 0;
  bool active_ = false;
  // kPartition in one process (no group, no host copy): stage() adds each gradient into the
  // accumulator itself, as the bucket's delivery would, without the bucket's copy. Only where
  // that is the same arithmetic: the communication dtype is the gradient's or fp32.
  bool accumulates_in_place_ = false;
};

}  // namespace strata::zero
