// strata::Engine wraps the user's unchanged torch::nn::Module and, from one JSON config, runs
// the training step: backward with gradient accumulation, data-parallel gradient averaging,
// fp16/bf16 with fp32 master weights and loss scaling, ZeRO stages 1-2, clipping, the optimizer
// and the LR schedule. The user's loop stays plain LibTorch:
//
//   auto engine = strata::initialize(model, "config.json");
//   for (...) {
//     auto loss = engine->forward(x, y);   // = model->forward(x, y)
//     engine->backward(loss);
//     engine->step();                      // optimizer step at the accumulation boundary
//   }
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/process_group.h"
#include "comm/topology.h"
#include "moe/expert_params.h"
#include "runtime/autocast.h"
#include "runtime/config/config.h"
#include "runtime/error.h"
#include "runtime/monitor/monitor.h"
#include "runtime/param_group.h"
#include "runtime/precision/loss_scaler.h"
#include "runtime/sched/lr_scheduler.h"
#include "zero/param_coordinator.h"
#include "zero/partitioned_init.h"
#include "zero/partitioned_optimizer.h"

namespace strata {
namespace checkpoint {
class CheckpointWriter;
class TensorFileWriter;
class CheckpointReader;
}  // namespace checkpoint

using OptimizerBuilder =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> params)>;
using SchedulerBuilder =
    std::function<std::unique_ptr<LRScheduler>(torch::optim::Optimizer& optimizer)>;

// What the program hands the engine beside the model and the config (DeepSpeed's client
// optimizer / scheduler, Hugging Face's values for "auto").
struct InitOptions {
  // A client optimizer, used when the config names none (naming one in both is an error).
  // Either an optimizer built over the model's parameters (fp32 stage 0 only), or a builder the
  // engine calls with the tensors it will optimise (with mixed precision or ZeRO: this rank's
  // fp32 master partition).
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  OptimizerBuilder optimizer_builder;
  // A client LR scheduler, used when the config names none; likewise an instance (built over
  // the client optimizer) or a builder called with the engine's optimizer.
  std::shared_ptr<LRScheduler> lr_scheduler;
  SchedulerBuilder lr_scheduler_builder;
  // MoE: builds the optimizer of the expert parameters (DeepSpeed's separate MoE parameter
  // groups), called with this rank's fp32 master partition of them, e.g. with another lr or
  // weight decay. Unset: the same optimizer as the other parameters. An LR schedule moves both
  // (the experts' lr keeps the ratio it had to the others' first group at construction; where
  // the others' lr was 0 then, the experts' follows it 1:1).
  OptimizerBuilder expert_optimizer_builder;
  AutoValues autos;
  // fp16 on a CPU device is refused at initialize: LibTorch 1.13's CPU kernels have no Half
  // matrix product or LayerNorm, so a model would fail in its first forward. Set it for a model
  // whose every op has a CPU Half kernel (the engine's own loss-scaling tests).
  bool allow_fp16_on_cpu = false;
  // ZeRO-3: the module paths whose parameters are gathered and released together ("units",
  // e.g. {"embed", "blocks.0", ...}). Empty: the children of every ModuleList / Sequential and
  // the remaining top-level modules (zero/param_units.h).
  std::vector<std::string> stage3_units;
  // ZeRO-3: the scope the model was built in (zero/partitioned_init.h, DeepSpeed's zero.Init):
  // its parameters arrive partitioned, and the engine builds its units from the shards.
  std::shared_ptr<zero::PartitionedInit> partitioned_init;
  // Where the model trains, when it is handed over somewhere else (built in host memory, e.g.
  // because it does not fit on the device whole). Unset: where its parameters are. At ZeRO
  // stage 3 each unit moves there as it is built, one at a time, and with offload_param and
  // offload_optimizer the shards are built in host memory directly, so the device never holds the
  // model (DeepSpeed's zero.Init(remote_device=...) serves this); below stage 3 the module moves
  // there once the ranks' models are checked and made rank 0's.
  std::optional<torch::Device> device;
  // The data-parallel group. Unset: when the environment names a world of several ranks
  // (WORLD_SIZE, OpenMPI's or SLURM's variables), strata::initialize meets the other ranks and
  // creates it; otherwise training is single-process.
  comm::GroupPtr group;
};

class Engine {
 public:
  Engine(std::shared_ptr<torch::nn::Module> module, Config config, InitOptions options);
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Scales the loss for gradient accumulation (1/gas, as DeepSpeed) and runs autograd.
  void backward(const torch::Tensor& loss);
  // One micro-step. At the accumulation boundary: clip, optimizer step, LR schedule, zero grads.
  void step();
  bool is_gradient_accumulation_boundary() const;

  int64_t global_steps() const { return global_steps_; }
  int64_t micro_steps() const { return micro_steps_; }
  int64_t global_samples() const { return global_steps_ * config_.train_batch_size.value; }
  int64_t train_batch_size() const { return config_.train_batch_size.value; }
  int64_t train_micro_batch_size_per_gpu() const {
    return config_.train_micro_batch_size_per_gpu.value;
  }
  int64_t gradient_accumulation_steps() const { return config_.gradient_accumulation_steps.value; }
  // Learning rate of each parameter group, as the next optimizer step will use it.
  std::vector<double> get_lr() const;
  // Global gradient norm before clipping at the last optimizer step (NaN before the first step,
  // and on the plain fp32 stage-0 path when clipping is off: the norm is then never computed).
  double last_grad_norm() const { return last_grad_norm_; }
  // The loss scale the next backward will use (1 unless fp16).
  double loss_scale() const { return scaler_.cur_scale(); }
  // Optimizer steps skipped because their gradients overflowed, and whether the last one was.
  int64_t skipped_steps() const { return skipped_steps_; }
  bool last_step_skipped() const { return last_step_skipped_; }
  // This rank's bytes of parameters, gradients, master weights and optimizer state.
  zero::ModelStateBytes model_state_bytes() const;
  // The most bytes of whole (gathered) parameters that existed on this rank during the last
  // optimizer step's window (stage 3; below it every parameter is whole all the time).
  int64_t live_param_bytes_peak() const;
  // Stage 3 with streamed experts (moe.expert_unit_size): the expert weights' bytes gathered at
  // once, at most, in the last optimizer step's window (the experts' coordinator's peak, counted
  // at every gather and release), and the bound moe.expert_window sets (that many of the largest
  // unit). Both 0 otherwise.
  int64_t expert_bytes_peak() const { return last_expert_peak_; }
  // NVMe offload: the traffic of every swap store this engine made, summed (zeros without).
  offload::NvmeStore::Traffic nvme_traffic() const;
  int64_t expert_window_bytes() const { return expert_window_bytes_; }
  // Stage 3: every parameter whole on this rank until the returned handle is dropped
  // (DeepSpeed's GatheredParameters, FSDP's summon_full_params), e.g. to print or save weights.
  // Every rank must enter it (it all-gathers). Changes made inside are not kept: the next
  // gather reads the shards. Below stage 3 it does nothing.
  [[nodiscard]] std::shared_ptr<void> gathered_parameters();
  // Optimizer offload: where the last step's host time went (null without offload).
  // NVMe optimizer offload: the swapper (its last pass's times, its size), or null.
  const offload::OptimizerSwapper* optimizer_swapper() const {
    return dense().partitioned() ? dense().partitioned()->swapper() : nullptr;
  }
  // Does not wait for an overlapped step still running (a trainer reads it every step; waiting
  // there would undo the overlap, ZenFlow's too): its CPU time is the last finished step's.
  std::optional<zero::OffloadTimes> last_offload_times() const {
    const auto* partitioned = dense().partitioned();
    if (!partitioned || !partitioned->offloads()) return std::nullopt;
    return partitioned->last_offload_times();
  }
  // Stage 3: the units the parameters are cut into (null below stage 3); with MoE, the experts'
  // units (one per MoE layer, sharded over the expert-data-parallel group) are apart.
  const zero::ParamUnits* stage3_units() const { return dense().units(); }
  zero::ParamCoordinator* stage3_coordinator() const { return dense().coordinator(); }
  const zero::ParamUnits* stage3_expert_units() const {
    return expert_group() ? expert_group()->units() : nullptr;
  }
  // The dense parameters' gradient reducer (its bucket counters), or null when none reduces.
  const zero::GradientReducer* gradient_reducer() const { return dense().reducer(); }
  // The MoE experts' reducer (over the expert-data-parallel group), or null.
  const zero::GradientReducer* expert_gradient_reducer() const {
    return expert_group() ? expert_group()->reducer() : nullptr;
  }
  zero::ParamCoordinator* stage3_expert_coordinator() const {
    return expert_group() ? expert_group()->coordinator() : nullptr;
  }
  // Checkpoints (runtime/checkpoint's layout: DIR/TAG/ with a manifest, DIR/latest): model
  // states, this rank's master weights and optimizer state, the loss scaler, the LR schedule,
  // the step counters and the program's own `client_state` (e.g. its data position). Every rank
  // calls both. The tag defaults to "global_step<N>". load_checkpoint returns the client state;
  // a checkpoint saved at another data-parallel world size is re-partitioned.
  void save_checkpoint(const std::string& dir, std::string tag = "",
                       const json& client_state = json::object());
  json load_checkpoint(const std::string& dir, const std::string& tag = "latest");
  // DeepSpeed's save_16bit_model: the weights as trained (16-bit under mixed precision) and the
  // buffers in one LibTorch module archive, DIR/FILE, that torch::load(model, path) reads. Every
  // rank calls it; rank 0 writes. At stage 3 it gathers the units one at a time and needs
  // zero_optimization.stage3_gather_16bit_weights_on_model_save (else strata::Error saying so).
  // With file "model.safetensors" it writes a Hugging Face folder's weights instead (safetensors,
  // shards of at most 5 GB with model.safetensors.index.json, the module's names, each tensor
  // once), streamed a unit at a time at stage 3; the program copies config.json beside them.
  void save_16bit_model(const std::string& dir, const std::string& file = "model.pt");
  // The config's monitors (tensorboard, csv_monitor): the engine writes train_loss, lr,
  // loss_scale, grad_norm and model-state memory at every optimizer step (x axis: samples, as
  // DeepSpeed); a program adds its own events (e.g. tokens/s) here. Only rank 0 writes.
  void write_monitor_events(const std::vector<monitor::Event>& events);
  bool monitors_enabled() const { return monitor_ && monitor_->enabled(); }

  const Config& config() const { return config_; }
  // The data-parallel group (null when single-process), its size and this process's rank in it.
  const comm::GroupPtr& data_parallel_group() const { return group_; }
  int data_parallel_size() const { return group_ ? group_->size() : 1; }
  int data_parallel_rank() const { return group_ ? group_->rank() : 0; }
  // Ulysses (sequence_parallel_size > 1, runtime/sequence/ulysses.h): this rank's
  // sequence-parallel group (comm::sequence_group's; null without), and the ranks that draw
  // different samples: batch_shards() of them, this rank drawing stream batch_shard() (the ranks
  // of one group draw the same samples and each feeds its shard of their positions). ZeRO still
  // partitions over the data-parallel group; the gradients are summed over each sequence group
  // and averaged over the batch shards.
  const comm::GroupPtr& sequence_parallel_group() const { return sequence_group_; }
  int sequence_parallel_size() const { return int(config_.sequence_parallel_size); }
  int batch_shards() const { return data_parallel_size() / sequence_parallel_size(); }
  int batch_shard() const { return data_parallel_rank() / sequence_parallel_size(); }
  torch::nn::Module& module() { return *module_; }
  // The optimizer of every parameter but MoE experts (of all of them without MoE).
  // With the optimizer offloaded, a step may still be running after step() returned (its tiles
  // overlap the next forward): these accessors wait for it first.
  torch::optim::Optimizer& optimizer() {
    settle_step();
    return *dense().optimizer();
  }
  // MoE: the expert parameters' optimizer (null without MoE layers), and the groups their
  // gradients are reduced over (expert_data_parallel) and their experts split over.
  torch::optim::Optimizer* expert_optimizer() {
    settle_step();
    return expert_group() ? expert_group()->optimizer().get() : nullptr;
  }
  const comm::ParallelGroups* expert_groups() const {
    return expert_group() ? &expert_groups_ : nullptr;
  }
  LRScheduler* lr_scheduler() { return lr_scheduler_.get(); }

 private:
  // The constructor's phases, in order.
  void validate(const InitOptions& options);  // what this build cannot run, refused by name
  // The module made ready: experts found, every rank's model checked and made rank 0's, a
  // PartitionedInit's shards taken in, the 16-bit cast, the trainable tensors listed.
  void prepare_module(const InitOptions& options);
  // InitOptions::device: the module's parameters and buffers not there yet move there (stage 3:
  // after the units are built on it, what is left: buffers, parameters outside every unit).
  void move_rest_to_device();
  // The parameter groups and their holders (runtime/engine_groups.cpp).
  void build_groups(InitOptions& options);
  void make_groups(InitOptions& options);
  void configure_lr_scheduler(InitOptions& options);
  void start_monitors();

  // runtime/engine_groups.cpp: the stage-3 groups (dense units, then one unit per MoE layer of
  // experts); the experts' partitioned optimizer (over `units` at stage 3, else `experts`).
  static bool uses_partitioned_optimizer(const Config& config);
  void build_unit_groups(const zero::PartitionedOptions& po, InitOptions& options);
  std::unique_ptr<zero::PartitionedOptimizer> make_expert_optimizer(
      const zero::PartitionedOptions& po, InitOptions& options,
      const std::shared_ptr<zero::ParamUnits>& units, const std::vector<torch::Tensor>& experts);
  static double optimizer_group_lr(const ParamGroup& group);
  std::shared_ptr<torch::optim::Optimizer> make_optimizer_over(std::vector<torch::Tensor> params,
                                                               InitOptions& options);
  // The groups: the dense parameters', first, and the MoE experts' (null without MoE).
  ParamGroup& dense() const { return *groups_.front(); }
  ParamGroup* expert_group() const { return groups_.size() > 1 ? groups_[1].get() : nullptr; }
  // Waits for an offloaded step that runs overlapped with the next forward (zero/weight_arrival.h).
  void settle_step();
  // At the accumulation boundary: every group prepared, then stepped (or the step skipped).
  void optimizer_step();
  // MoE (runtime/engine_experts.cpp): finds the expert parameters, checks them, meets the
  // expert groups; after the LR schedule moved the others' lr, the experts' follows.
  void find_experts();
  void refuse_experts_outside_moe_layers() const;
  // Keys each MoE layer's gate noise by this forward's global micro-batch (moe/layer.h).
  void key_gate_noise();
  void check_and_broadcast_experts();
  void follow_lr_schedule();
  // The sigmoid router's bias (moe/layer.h): after an optimizer step, each balancing layer's
  // loads summed over the step's micro-batches and every rank move its bias toward balance;
  // checked identical on every rank.
  void balance_experts();
  // Stage 3: the dense units and the experts' (each coordinator gathers over its own group).
  std::vector<zero::ParamCoordinator*> coordinators() const;
  bool is_expert(const torch::Tensor& p) const;
  std::unordered_set<std::string> expert_names() const;
  // Expert checkpoints (per expert, so that they load at another ep_size), with the MoE layers'
  // call counters (their gate noise; older checkpoints: the saved micro-steps).
  void save_expert_states(checkpoint::CheckpointWriter& writer);
  GroupInstall read_expert_states(const checkpoint::CheckpointReader& reader,
                                  int64_t saved_micro_steps);
  // The dense group's optim_states (runtime/engine_checkpoint.cpp): its flat layout's partitions
  // with their place in it, or the plain path's per-parameter state.
  void save_dense_states(checkpoint::CheckpointWriter& writer);
  GroupInstall read_dense_states(const checkpoint::CheckpointReader& reader, int64_t);

 protected:
  // Stage 3: the model may gather parameters while the returned scope lives; end_forward()
  // raises what went wrong inside (a failed gather).
  std::vector<zero::ParamCoordinator::Scope> begin_forward();
  void end_forward();
  // fp16.auto_cast: the dtype the forward's floating-point inputs are cast to (the model's 16-bit
  // dtype), or none.
  std::optional<torch::ScalarType> input_cast_dtype() const { return input_cast_dtype_; }
  // torch_autocast for the model's device (disabled: autocast off inside the forward).
  const AutocastPlan& autocast_plan() const { return autocast_plan_; }

 private:
  void log_step() const;
  // Stage 3 (collective): the module's parameters (every name; MoE experts only `with_experts`,
  // else left out) and buffers as host copies, gathered unit by unit; empty unless `keep` (only
  // rank 0 keeps them).
  std::vector<std::pair<std::string, torch::Tensor>> stage3_host_copies(bool keep,
                                                                        bool with_experts);
  // Stage 3: the module's parameters (the experts' left out) and buffers into `out` (rank 0;
  // null on the others, which gather along), each unit gathered and written in turn, so that no
  // more than one unit is whole in memory.
  void stream_stage3_model(checkpoint::TensorFileWriter* out);
  // save_16bit_model's safetensors folder (rank 0 writes; every rank gathers along at stage 3).
  void stream_16bit_safetensors(const std::string& dir, bool writer);
  // Stage 3: the saved parameters into the units' shards, the buffers into the module.
  template <class TensorFile>
  void install_stage3_weights(const TensorFile& states);
  void write_step_events();
  // fp16.auto_cast and torch_autocast: what the forward does, and (torch_autocast) the loss scale
  // of fp16 and the dtype gradients are reduced in.
  void configure_autocast();
  torch::ScalarType gradient_comm_dtype() const;
  // offload_optimizer (engine_offload.cpp): the partitioned optimizer's offload options (with
  // NVMe, the store its swap files live in), then, once it is built, the swapped Adam and a
  // line saying where the state lives.
  zero::OffloadOptions optimizer_offload_options();
  void finish_optimizer_offload();
  // offload_param (stage 3): the units' trainable shards to host memory or an NVMe swap file.
  void offload_parameters();
  std::shared_ptr<offload::NvmeStore> make_nvme_store(const std::string& nvme_path);
  std::string swap_job_id_;  // names this job's swap folders (engine_offload.cpp)

  std::shared_ptr<torch::nn::Module> module_;
  Config config_;
  comm::GroupPtr group_;
  comm::GroupPtr sequence_group_;  // Ulysses: sequence_parallel_group()
  torch::Device device_{torch::kCPU};  // where the model trains (InitOptions::device)
  std::vector<torch::Tensor> params_;  // trainable parameters, in module order
  // How the parameters are held, reduced and stepped: the dense group, then the experts'
  // (declared before the LR schedule, which refers to their optimizers).
  std::vector<std::unique_ptr<ParamGroup>> groups_;
  std::vector<std::weak_ptr<offload::NvmeStore>> nvme_stores_;  // every store made, for traffic
  std::shared_ptr<offload::NvmeStore> nvme_store_;  // offload_optimizer.device "nvme"
  std::shared_ptr<LRScheduler> lr_scheduler_;
  // MoE: the expert parameters (trainable, module order), in a group of their own over the
  // expert-data-parallel group.
  std::vector<moe::ExpertParameter> experts_;
  std::vector<moe::MoEImpl*> moe_layers_;  // the model's MoE layers, module order
  comm::ParallelGroups expert_groups_;
  double expert_lr_ratio_ = 1.0;  // experts' lr / the others' first group's, at construction
  LossScaler scaler_;
  bool skip_on_overflow_ = false;
  std::unique_ptr<monitor::MonitorMaster> monitor_;  // enabled on rank 0 only
  bool monitored_ = false;     // some monitor is on in the config (every rank then agrees)
  torch::Tensor window_loss_;  // sum of this window's micro-step losses, kept only when monitored
  int64_t global_steps_ = 0;
  int64_t micro_steps_ = 0;
  int64_t skipped_steps_ = 0;
  bool last_step_skipped_ = false;
  bool tiling_checked_ = false;  // mlp_tiles set and never used: warned after the first backward
  uint64_t tiled_calls_at_start_ = 0;  // checkpointing::tiled_calls() when the engine was built
  uint64_t exchanges_at_start_ = 0;    // sequence::exchanges() then (Ulysses' check)
  int64_t last_live_peak_ = 0;  // stage 3: live_param_bytes_peak() of the last window
  int64_t last_expert_peak_ = 0, expert_window_bytes_ = 0;  // streamed experts
  double last_grad_norm_;
  std::optional<torch::ScalarType> input_cast_dtype_;
  AutocastPlan autocast_plan_;
  bool autocast_safe_params_only_ = false;  // every trainable parameter in a safe module
  bool model_cast_ = false;                 // torch_autocast over fp16/bf16 parameters
};

// The engine typed by the user's module, so that forward() calls the module's own forward with
// its own signature. Going through engine->forward() is where later stages attach (stage-3
// gathering, autocast) without the model knowing.
template <class ModuleHolder>
class ModelEngine : public Engine {
 public:
  ModelEngine(ModuleHolder model, Config config, InitOptions options)
      : Engine(model.ptr(), std::move(config), std::move(options)), model_(std::move(model)) {}

  template <class... Args>
  auto forward(Args&&... args) {
    auto scope = begin_forward();
    AutocastScope autocast(autocast_plan());
    auto out = call_model(std::forward<Args>(args)...);
    end_forward();
    return out;
  }
  ModuleHolder& model() { return model_; }

 private:
  template <class... Args>
  auto call_model(Args&&... args) -> decltype(std::declval<ModuleHolder&>()->forward(std::forward<Args>(args)...)) {
    if (const auto dtype = input_cast_dtype()) {
      if constexpr (AcceptsCastInputs<ModuleHolder, void, Args...>::value)
        return model_->forward(cast_floating_inputs(std::forward<Args>(args), *dtype)...);
      else
        throw Error(fmt::format("{}: fp16.auto_cast: the model's forward takes a non-const tensor "
                                "reference, which cannot receive a cast copy; take the tensors by "
                                "value or const reference, or set auto_cast false",
                                config().source));
    }
    return model_->forward(std::forward<Args>(args)...);
  }

  ModuleHolder model_;
};

// Meets the other ranks when the environment names several (filling options.group), then reads
// and validates the config for this program: the world size, the "auto" values, and the
// optimizer and scheduler names registered so far.
Config load_engine_config(const std::string& path, InitOptions& options);
Config load_engine_config(const json& config, InitOptions& options);

template <class ModuleHolder>
std::shared_ptr<ModelEngine<ModuleHolder>> initialize(ModuleHolder model,
                                                      const std::string& config_path,
                                                      InitOptions options = {}) {
  auto config = load_engine_config(config_path, options);
  return std::make_shared<ModelEngine<ModuleHolder>>(std::move(model), std::move(config),
                                                     std::move(options));
}

template <class ModuleHolder>
std::shared_ptr<ModelEngine<ModuleHolder>> initialize(ModuleHolder model, const char* config_path,
                                                      InitOptions options = {}) {
  return initialize(std::move(model), std::string(config_path), std::move(options));
}

template <class ModuleHolder>
std::shared_ptr<ModelEngine<ModuleHolder>> initialize(ModuleHolder model, const json& config,
                                                      InitOptions options = {}) {
  auto resolved = load_engine_config(config, options);
  return std::make_shared<ModelEngine<ModuleHolder>>(std::move(model), std::move(resolved),
                                                     std::move(options));
}

}  // namespace strata
