// Mixed precision and ZeRO stages 1-2 around an ordinary optimizer (DeepSpeed's
// FP16_Optimizer / BF16_Optimizer / DeepSpeedZeroOptimizer in one place).
//
// The model's trainable parameters live in one flat buffer in the model's dtype (fp32, bf16 or
// fp16). The fp32 master copy covers this rank's partition of that buffer (stage 1, 2) or all
// of it (stage 0), and the inner optimizer (from the registry, or the program's) sees only that
// fp32 master tensor, so its state is partitioned with it. Which flat elements a partition holds
// is the ShardMap's business (shard_map.h): one contiguous range per rank at stage 0/1, every
// gradient bucket cut across the ranks at stage 2. Gradients:
//   - stage 0, 1: each .grad is a view into one flat gradient buffer; on the boundary
//     micro-step the reducer averages them over the data-parallel group (all-reduce);
//   - stage 2: every micro-step's gradients are reduce-scattered in buckets during backward and
//     this rank's chunk of each is accumulated (in the accumulation dtype); no full gradient
//     buffer exists.
// Accumulating in fp32 over several micro-steps at stage 0, 1 (DeepSpeed's BF16_Optimizer): after
// each micro-step the 16-bit gradients are added into an fp32 flat buffer and zeroed; at the
// boundary that buffer is all-reduced (after backward, not overlapped with it).
// At the boundary the engine (which owns the loss scaler) calls prepare(): one sum of squares of
// the partition's gradient, all-reduced, gives both the overflow flag and the global norm (the
// step's one host sync). Then discard() (an overflowing step is skipped) or apply(): unscale and
// clip, inner step, copy the master into the 16-bit partition, all-gather partitions (and put
// each rank's pieces in place in the flat buffer).
//
// Two ways to run the inner step. By default the partition's gradient is materialised in fp32 as
// the master's .grad and the inner optimizer's step() runs (any torch::optim::Optimizer). With a
// flat step (use_flat_step: Strata's Adam, fused_adam.h) the step reads the gradient in the
// model's dtype with the unscale/clip factor applied on the fly and writes the 16-bit partition in
// the same pass: no fp32 gradient copy, no separate copy-out.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <utility>
#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "offload/adam_math.h"
#include "offload/nvme_store.h"
#include "offload/optimizer_swapper.h"
#include "zero/flat_params.h"
#include "zero/gradient_swap.h"
#include "zero/gradient_reducer.h"
#include "zero/param_units.h"
#include "zero/shard_map.h"
#include "zero/speculative_step.h"
#include "zero/weight_arrival.h"

namespace strata::zero {

// ZeRO-Offload (DeepSpeed's offload_optimizer.device "cpu", stages 1-3): the fp32 master and the
// optimizer state live in host memory and the step runs on the CPU. Gradients leave the device
// as each bucket is reduced (stages 2-3; stage 1 copies its partition at the boundary) into a
// host buffer, micro-steps are summed there in fp32, and the new 16-bit weights go back tile by
// tile (tile_numel, DeepSpeed's sub_group_size): the copy of one tile overlaps the CPU step of
// the next. Host buffers that cross to a GPU are page-locked when pin_memory is set, within the
// process's RLIMIT_MEMLOCK; past it (or when pinning fails) they are pageable, said once.
//
// NVMe (ZeRO-Infinity's offload_optimizer.device "nvme", stage 3): `nvme` is set and the master
// weights and Adam's two moments live in three swap files of that store instead of host memory
// (offload/optimizer_swapper.h). A step streams them through host buffers of tile_numel
// elements, reading the next tile and writing the last while the CPU steps this one
// (pipeline_read / pipeline_write), so host memory holds the gradient partition, the 16-bit
// weights on their way back and 2 x 3 tiles, not 12 bytes per parameter. It steps Adam only,
// through use_swapped_step().
struct OffloadOptions {
  bool enabled = false;
  bool pin_memory = true;
  int64_t tile_numel = 0;  // 0: the whole partition in one step
  std::shared_ptr<offload::NvmeStore> nvme;
  std::string swap_name = "optimizer";  // the swap files' names in the store
  bool pipeline_read = false, pipeline_write = false;
  // offload_optimizer.max_in_cpu with the state on NVMe: elements of state (master and moments
  // alike) still allowed in host memory, shared by every partition of the rank; each takes what
  // its first tiles need as its swapper is built (offload/optimizer_swapper.h).
  std::shared_ptr<int64_t> host_budget;
  // offload_optimizer.super_offload (host memory, Strata's Adam): the boundary micro-step's CPU
  // step starts during backward, speculatively, and is kept only where exact
  // (zero/speculative_step.h).
  bool speculative = false;
  // 1 - offload_optimizer.ratio (stages 1-2, Strata's Adam): this share of the partition, the
  // buckets backward reaches last (the first layers), keeps its fp32 master and moments on the
  // model's device and is stepped there, at once after backward, while the CPU steps the rest
  // (SuperOffload's split, DeepSpeed's Twin-Flow partial offload).
  double device_share = 0.0;
};

// Where the last offloaded step's host time went (ms): waiting for the device's gradient copies,
// the gradient norm on the host, the CPU step with the weights' copies queued.
struct OffloadTimes {
  double wait_ms = 0, norm_ms = 0, step_ms = 0;
  // An overlapped step: the next forward's ops that waited for a tile still being stepped.
  int64_t forward_waits = 0;
  // super_offload, counted since the start: steps begun speculatively during backward, and those
  // of them redone after backward (clipping applied or the learning rate changed) or dropped (an
  // overflow). The speculative step's CPU Adam time is step_ms.
  int64_t speculated = 0, redone = 0;
  // ZenFlow (PartitionedOptions::zenflow): the columns and elements the device steps now, and the
  // optimizer steps the CPU's part has summed since its last update (its staleness).
  int64_t zenflow_columns = 0, zenflow_device_elements = 0, zenflow_stale_steps = 0;
  // ZenFlow, where a window's CPU update spends its time: the last update's CPU Adam (ms) and its
  // wait for the window's sum to reach host memory; since the start, the updates run and the
  // training thread's waits for them (a window's update slower than the next window stalls it).
  double zenflow_cpu_ms = 0, zenflow_copy_wait_ms = 0, zenflow_stall_ms = 0;
  int64_t zenflow_updates = 0;
};

// ZenFlow (zero_optimization.zenflow, docs/zenflow.md), stages 1-2 with the optimizer offloaded
// on one partition: the top topk_ratio of each 2-D weight's gradient columns (by L1 norm), and
// every 1-D parameter, keep their fp32 master and moments on the device and are stepped there at
// every step; the rest is summed in fp32 on the device and stepped by the CPU every
// update_interval steps on the window's mean. The gradient stays on the device (as without
// offload): only the window's sum crosses to the host, once per window. After warm_up plain steps the first selection;
// then one every select_interval steps (0: never again), right after a CPU update, the leaving
// elements' state written back into the host arrays and the arriving ones' read from them.
// overlap: the CPU update of a window runs on a worker thread (with 1 - reserved_cores of the
// intra-op threads) while the next window trains; its weights are installed at that window's end.
struct ZenFlowOptions {
  bool enabled = false;
  bool overlap = false;
  double reserved_cores = 0.5;
  double topk_ratio = 0.1;
  int64_t select_interval = 0;
  int64_t update_interval = 1;
  int64_t warm_up = 0;
};

struct PartitionedOptions {
  int64_t stage = 0;  // 0, 1, 2 or 3 (3: the constructor that takes the ParamUnits)
  torch::ScalarType comm_dtype = torch::kFloat;
  int64_t reduce_bucket_numel = 0;
  // Micro-steps per optimizer step, and the dtype their gradients are summed in (DeepSpeed's
  // data_types.grad_accum_dtype): with more than one micro-step and an accumulation dtype wider
  // than the model's, gradients are summed in it (fp32) so that 16-bit rounding does not build
  // up over the window. One micro-step needs no accumulator.
  int64_t accumulation_steps = 1;
  torch::ScalarType accum_dtype = torch::kFloat;
  OffloadOptions offload;
  ZenFlowOptions zenflow;
  // MoE expert parameters (DeepSpeed's expert-data-parallel reduction): the group given to the
  // constructor is the expert-data-parallel group, over which gradients are averaged, while the
  // loss is a mean over the whole world, so the reduced gradient is multiplied by
  // gradient_factor (expert-DP size / world size). The gradient's squares are also summed over
  // norm_group (the expert-parallel group, whose ranks hold the other experts), so that the
  // norm counts every expert once.
  double gradient_factor = 1.0;
  comm::GroupPtr norm_group;
  // GradientReducer::Options::settle_unreached (the streamed experts' reducer).
  bool settle_unreached = false;
};

struct GradientSummary {
  bool overflow = false;   // an inf or NaN anywhere, on any rank
  double grad_norm = 0.0;  // global norm of the unscaled gradient
};

// This rank's bytes of model states, by the engine's own accounting: in device or host memory
// (params .. optimizer), and apart, what lives in NVMe swap files (ZeRO-Infinity: the master and
// the moments with offload_optimizer nvme, the parameter shards with offload_param nvme), which
// total() leaves out.
struct ModelStateBytes {
  int64_t params = 0, grads = 0, master = 0, optimizer = 0;
  int64_t host = 0;  // of total(), the bytes in host memory (the rest are on the device)
  int64_t nvme = 0;  // beside total(): swap files
  int64_t total() const { return params + grads + master + optimizer; }
  int64_t device() const { return total() - host; }
};

class PartitionedOptimizer {
 public:
  using InnerBuilder =
      std::function<std::shared_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  // The inner optimizer's fused step over master(): (gradient in the model's dtype, factor to
  // apply to it, tensor that receives the new weights in the model's dtype or undefined).
  // With tile_numel > 0 it steps tile by tile and calls after_tile(offset, numel) as each tile's
  // copy_out is written (optim::Adam::step_flat).
  using TileDone = std::function<void(int64_t offset, int64_t numel)>;
  using FlatStep = std::function<void(const torch::Tensor& grad, double grad_scale,
                                      const torch::Tensor& copy_out, int64_t tile_numel,
                                      const TileDone& after_tile)>;

  PartitionedOptimizer(std::vector<torch::Tensor> params, comm::GroupPtr group,
                       PartitionedOptions options, const InnerBuilder& make_inner);
  // Stage 3: the 16-bit partition is the units' trainable shards (param_units.h); gradients
  // are reduce-scattered per unit as at stage 2; a step writes new shards, which the next
  // gathers pick up (the persistent unit is gathered again at once).
  PartitionedOptimizer(std::shared_ptr<ParamUnits> units, comm::GroupPtr group,
                       PartitionedOptions options, const InnerBuilder& make_inner);
  ~PartitionedOptimizer();  // waits for ZenFlow's overlapped CPU update, which reads the members

  // loss_scale: what the loss is multiplied by in this backward (the speculative step's factor).
  void begin_backward(bool boundary, const torch::Tensor& loss = {}, double loss_scale = 1.0);
  // Right after each backward: one process at stages 0-1 settles the gradients it wrote in
  // place, and .grad is each parameter's view of them again.
  void end_backward();
  // After every micro-step's backward: completes that micro-step's gradient reduction.
  void end_micro_step();
  // Use the inner optimizer's fused flat step from now on (set before the first step).
  void use_flat_step(FlatStep step) { flat_step_ = std::move(step); }
  // NVMe offload: the inner Adam's scalars for the next step (its step count advanced,
  // optim::Adam::next_flat_scalars) given the gradient's factor; the swapper streams the arrays.
  using SwappedScalars = std::function<optim::AdamScalars(double grad_scale)>;
  void use_swapped_step(SwappedScalars scalars) { swapped_scalars_ = std::move(scalars); }
  bool uses_flat_step() const { return static_cast<bool>(flat_step_); }
  // Optimizer offload with Strata's Adam: the next step's scalars (its count advanced unless
  // `advance` is false: a speculative step's) and the moments of master(), taken on the caller's
  // thread. Given this, a one-partition offloaded
  // step (stages 1-2 on one data-parallel rank) runs on a worker thread while the caller goes
  // on to the next forward, whose ops wait for the tiles they read (weight_arrival.h); the
  // tiles are stepped in the flat layout's order, the order a forward reads the weights in.
  struct AdamTiles {
    optim::AdamScalars scalars;
    torch::Tensor exp_avg, exp_avg_sq;  // fp32, master()'s shape, in host memory
  };
  using OverlappedStep = std::function<AdamTiles(double grad_scale, bool advance)>;
  void use_overlapped_step(OverlappedStep begin) { overlapped_step_ = std::move(begin); }
  // OffloadOptions::device_share: the fused Adam over device tensors (master, moments, gradient,
  // new weights in the model's dtype) with the step's scalars.
  using DeviceStep = std::function<void(const torch::Tensor& p, const torch::Tensor& m,
                                        const torch::Tensor& v, const torch::Tensor& grad,
                                        const torch::Tensor& out, const optim::AdamScalars& s)>;
  void use_device_step(DeviceStep step) { device_step_ = std::move(step); }
  // The partition elements whose optimizer stays on the device: [first, second) (empty: none).
  std::pair<int64_t, int64_t> device_range() const { return {device_lo_, device_hi_}; }
  // With a device share: its master and moments into master() and the inner optimizer's host
  // state (before they are read: checkpoints), and back (after they were written).
  void store_device_share();
  void load_device_share();
  // ZenFlow's state beyond the master and moments (store_device_share() puts the selected
  // elements' there), for checkpoints: the steps applied, the window's count and fp32 sum, the
  // selection as a 0/1 mask over the partition. Host tensors; none without ZenFlow.
  // pending_steps > 0: an overlapped CPU update of that many steps is in the master and moments,
  // its weights not installed yet.
  struct ZenFlowCheckpoint {
    int64_t steps = 0, window = 0, columns = 0, pending_steps = 0;
    torch::Tensor sum, selected;
  };
  std::optional<ZenFlowCheckpoint> zenflow_checkpoint() const;
  // After the host master and moments were written (load_device_share() then reads the
  // selected elements' device state from them); an empty one (no tensors) starts ZenFlow afresh.
  void restore_zenflow(const ZenFlowCheckpoint& saved);
  bool zenflow() const { return zenflow_ != nullptr; }
  // Waits for an overlapped step still running: afterwards every new weight is in place (the
  // caller's current stream included) and a failure of the step is thrown. The methods below
  // that change state call it; a caller that reads master(), the inner optimizer's state or the
  // weights' raw bytes calls it first.
  void settle();
  // Whether the offloaded step runs overlapped (see above).
  bool overlaps_step() const;
  // Whether the boundary's step starts speculatively during backward (OffloadOptions::speculative
  // with Strata's Adam given through use_overlapped_step).
  bool speculates() const;
  // At the accumulation boundary: the gradients carry `loss_scale`.
  GradientSummary prepare(double loss_scale);
  // The prepared step: scale the gradient by clip_coef (1 = no clipping), step, share results.
  void apply(double clip_coef);
  // The prepared step is skipped: gradients dropped, nothing else changes.
  void discard();

  const std::shared_ptr<torch::optim::Optimizer>& inner() const { return inner_; }
  // Stages 0-2: the flat buffer of the model's parameters (there is none at stage 3).
  const FlatParams& flat() const;
  ParamUnits* units() const { return units_.get(); }
  bool offloads() const { return options_.offload.enabled; }
  // The step's gradient crosses to host memory (optimizer offload, except ZenFlow's, whose
  // gradient stays on the device and whose window sum crosses instead).
  bool host_gradient() const { return options_.offload.enabled && !options_.zenflow.enabled; }
  int64_t pinned_host_bytes() const { return pinned_bytes_; }
  // Where the last steps' host time went. Does not wait for an overlapped step still running
  // (read every step, it must not undo the overlap): its CPU time is then the last finished one's.
  OffloadTimes last_offload_times() const;
  // The fp32 master weights of partition partition_index() of flat(), laid out as shards()
  // says (the inner optimizer's one parameter); a checkpoint restores them in place. Under NVMe
  // offload it has the partition's shape and no bytes: the arrays are in the swap files.
  const torch::Tensor& master() const { return master_; }
  bool swaps() const { return swapper_ != nullptr; }
  bool swaps_gradients() const { return grad_swap_ != nullptr; }
  // NVMe offload: one array (master, exp_avg, exp_avg_sq) of the swap files as a new fp32 host
  // tensor, or overwritten from one (checkpoints), a tile at a time.
  torch::Tensor read_swapped(offload::OptimizerSwapper::Array a) const;
  void write_swapped(offload::OptimizerSwapper::Array a, const torch::Tensor& values);
  void fill_swapped(offload::OptimizerSwapper::Array a, float value);  // no host copy needed
  // The same a tile at a time (checkpoints of partitions that do not fit host memory whole).
  void read_swapped_tiles(offload::OptimizerSwapper::Array a,
                          const offload::OptimizerSwapper::TileIn& consume) const;
  void write_swapped_tiles(offload::OptimizerSwapper::Array a,
                           const offload::OptimizerSwapper::TileOut& produce);
  const offload::OptimizerSwapper* swapper() const { return swapper_.get(); }
  const ShardMap& shards() const { return shards_; }
  int64_t partition_index() const { return shards_.parts() > 1 ? rank_ : 0; }
  // Parameters, gradients and master weights (the inner optimizer's state is counted by the
  // caller, which knows the optimizer types).
  ModelStateBytes state_bytes() const;

  // The gradient reducer (its bucket counters: tests, benchmarks); null when none reduces.
  const GradientReducer* reducer() const { return reducer_.get(); }

 private:
  void init_master(const torch::Tensor& partition, const InnerBuilder& make_inner);
  void own_local_gradients();  // stage 0, 1: every .grad is its view of grad_flat_ again
  bool accumulates_wide() const { return grad_accum_.defined(); }
  // The step reads the gradient in its own dtype with the factor applied on the fly.
  bool steps_flat() const { return flat_step_ || swapper_; }
  // send: where each tile's new weights go from host_out_; empty: straight from tile buffers to
  // the parameters' swap file.
  void step_swapped(double grad_scale, const std::function<void(int64_t, int64_t)>& send);
  torch::Tensor partition_gradient() const;  // in the accumulation dtype, no copy
  void zero_gradients();
  // Optimizer offload: a host buffer, page-locked when it will cross to a GPU and allowed.
  torch::Tensor host_buffer(int64_t numel, torch::ScalarType dtype);
  void set_device(const torch::Tensor& params);  // device_ and pin_ from the model's tensors
  bool accumulates_wider_than(torch::ScalarType model_dtype) const;
  // Stages 2-3: the buffer the reducer leaves this rank's gradient in (on the device, or in
  // host memory with offload), given to the reducer's options.
  void place_partition_gradients(GradientReducer::Options& r, const torch::Tensor& params);
  void wait_for_device() const;  // the device's queued copies into host buffers are done
  // Writes the new weights into `mine` (on the device) from the host step.
  void apply_offloaded(double clip_coef, const torch::Tensor& mine);
  void start_overlapped_step(double clip_coef);
  // The offloaded step's pieces: each bucket's chunk (one range at stage 1) cut into tiles,
  // in flat order (the order a forward reads the weights).
  std::vector<SpeculativeStep::Item> step_items() const;
  // The speculative step: begun before the boundary's backward; given the pieces of the gradient
  // as they land (stage 1: all of them at the end of backward); kept by apply() where the
  // step's scalars are those assumed, else dropped.
  void begin_speculation(double loss_scale);
  void arrive_stage1_gradient();
  bool commit_speculation(double clip_coef, const torch::Tensor& mine);
  // Sends the new weights in spec_out_ [lo, lo + n) to where the partition's weights live.
  void send_weights(const torch::Tensor& mine, int64_t lo, int64_t n);
  // The device share (partitioned_device_share.cpp): its range chosen from the buckets, its
  // gradient (stage 1: a range of the flat gradient; stage 2: device_grad_), its step with the
  // step's scalars writing the new weights into the device buffer `mine` (stage 1-2 with several
  // partitions: the partition's weights) or straight into the flat buffer (one partition).
  void plan_device_share();
  bool splits() const { return device_hi_ > device_lo_; }
  bool in_device_share(int64_t part) const { return part >= device_lo_ && part < device_hi_; }
  torch::Tensor device_share_gradient() const;
  void step_device_share(const optim::AdamScalars& s, const torch::Tensor& mine);
  // The CPU's part of the partition's gradient copied to host_grad_ (stage 1), its sum of squares.
  double host_sum_squares(const torch::Tensor& grad) const;

  PartitionedOptions options_;
  comm::GroupPtr group_;
  int64_t rank_ = 0;
  std::unique_ptr<FlatParams> flat_;  // stages 0-2
  std::shared_ptr<ParamUnits> units_;  // stage 3
  ShardMap shards_;
  // ZenFlow's state (zero/zenflow.cpp).
  struct ZenFlowState {
    int64_t steps = 0;          // optimizer steps applied (warm-up included)
    int64_t window = 0;         // steps summed into `sum` since the last CPU update
    torch::Tensor sum;          // device fp32, the partition's shape: those steps' clipped gradients
    torch::Tensor host_sum;     // its copy in host memory for the CPU update (page-locked)
    torch::Tensor part_index;   // host int64: the selected elements' places in the partition
    torch::Tensor device_index; // the same on the device (the gradient's and the sum's)
    torch::Tensor flat_index;   // device int64: their places in the flat buffer
    torch::Tensor master, exp_avg, exp_avg_sq;  // device fp32, one per selected element
    int64_t columns = 0;
    // A CPU update whose new weights (host_out_) wait to be installed, of pending_steps steps;
    // overlap_step runs it on `worker` and sums the next window into `spare` meanwhile.
    bool pending = false;
    int64_t pending_steps = 0;
    std::future<void> worker;
    torch::Tensor spare;
    // The worker's new weights already on the device, in `spare` (free once its sum has crossed),
    // copied there on the copy stream: the install is then a device copy. Null: from host_out_.
    comm::WorkPtr staged;
    // The last CPU update's times (written by the worker, read once it is settled).
    double cpu_ms = 0, copy_wait_ms = 0;
  };
  std::unique_ptr<ZenFlowState> zenflow_;
  void apply_zenflow(double clip_coef, const torch::Tensor& mine);
  void zenflow_select(const AdamTiles& adam);
  void clear_zenflow_selection();  // nothing selected: every element the CPU's
  // The selected elements' master and moments from the device into the host arrays, and back.
  void zenflow_hand_back(const AdamTiles& adam);
  void zenflow_take(const AdamTiles& adam);
  // The CPU Adam over every element with the window's mean (host_sum) into host_out_.
  void zenflow_cpu_update(const AdamTiles& adam, const optim::AdamScalars& s, int threads);
  void settle_zenflow();  // waits for an overlapped CPU update (rethrows its failure)
  void zenflow_stage_update();            // the worker's new weights into `spare` (staged)
  torch::Tensor zenflow_staging() const;  // `spare`'s first bytes, in the weights' dtype
  // A CPU update done: its times into offload_times_, with the training thread's wait for it.
  void count_zenflow_update(double stall_ms);
  // Writes a pending update's new weights into the flat layout (the selected elements keep the
  // device's).
  void install_zenflow_update(const torch::Tensor& mine);
  torch::Tensor grad_flat_;       // stage 0, 1: full gradients, model dtype
  bool writes_local_gradients_ = false;  // one process, stage 0, 1: reducer_ writes grad_flat_
  torch::Tensor grad_accum_;      // stage 0, 1, wide accumulation: full gradients, fp32
  torch::Tensor grad_partition_;  // stage 2: this rank's gradients, accumulation dtype
  bool boundary_ = false;         // the running backward ends the accumulation window
  torch::Tensor master_;          // fp32 partition (stage 0: everything)
  std::shared_ptr<torch::optim::Optimizer> inner_;
  std::shared_ptr<GradientReducer> reducer_;
  FlatStep flat_step_;
  std::unique_ptr<offload::OptimizerSwapper> swapper_;  // NVMe offload
  offload::AlignedBuffer tile_out_[2];  // NVMe offload of state and parameters: new weights
  SwappedScalars swapped_scalars_;
  std::unique_ptr<GradientSwap> grad_swap_;  // NVMe offload, one micro-step: the gradient's file
  torch::Tensor grad_;       // the prepared gradient of the partition (fp32 unless flat_step_)
  double grad_scale_ = 1.0;  // flat step: the factor still to apply to grad_ (1 / loss scale)
  // Optimizer offload (the master above is then in host memory too).
  torch::Device device_ = torch::kCPU;  // where the model's parameters are
  torch::Tensor host_grad_;   // this rank's gradient as it arrives from the device
  torch::Tensor host_accum_;  // fp32 sum over the micro-steps of a window (more than one)
  torch::Tensor host_out_;    // the step's new weights in the model's dtype, on their way back
  torch::Tensor device_sum_squares_;  // stages 2-3, one micro-step per window: the gradient's
                                      // sum of squares, added up on the device by the reducer
  bool pin_ = false;          // host buffers are page-locked (model on a GPU, pin_memory)
  int64_t pinned_bytes_ = 0;
  OffloadTimes offload_times_;
  std::atomic<double> overlapped_step_ms_{0.0};  // written by the overlapped step's worker
  OverlappedStep overlapped_step_;
  int64_t device_lo_ = 0, device_hi_ = 0;  // the device share's partition range
  torch::Tensor device_master_, device_exp_avg_, device_exp_avg_sq_;  // on device_
  torch::Tensor device_grad_;  // stage 2: the device share's gradient, summed over the window
  torch::Tensor device_out_;   // its new weights in the model's dtype (stage 2, one partition)
  DeviceStep device_step_;
  torch::Tensor spec_out_;  // super_offload: the speculative step's new weights (host)
  std::function<void()> spec_out_free_;  // waits for the copies that read spec_out_ last step
  std::unique_ptr<SpeculativeStep> speculative_;  // super_offload (joined before the buffers go)
  std::unique_ptr<WeightArrival> arrival_;  // the overlapped step in flight (declared last: it
                                            // is joined before the buffers it reads go)
};

}  // namespace strata::zero
