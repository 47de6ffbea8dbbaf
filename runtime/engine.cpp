#include "runtime/engine.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>

#include "comm/topology.h"
#include "runtime/checkpointing/settings.h"
#include "runtime/sequence/ulysses.h"
#include "runtime/util/tiled.h"
#include "runtime/cpu_threads.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/model_check.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/registry.h"
#include "runtime/optim/state_bytes.h"
#include "runtime/sched/registry.h"
#include "zero/gradient_reducer.h"

namespace strata {
namespace {

// Creates the data-parallel group when the environment names a world of several ranks. The
// group the environment describes is created once per process and kept (as torch.distributed
// keeps its default group): a second engine in the same program joins the same group instead
// of meeting the other ranks again on the same port.
void connect(InitOptions& options) {
  const auto env = comm::read_rank_env();
  // Ranks sharing a machine share its cores (before any rank starts its thread pools' work).
  configure_cpu_threads(env.local_world_size);
  if (options.group) return;
  if (env.world_size <= 1) return;
  static std::mutex mutex;
  static comm::GroupPtr world;
  std::lock_guard<std::mutex> lock(mutex);
  if (!world) world = comm::init_process_group();
  options.group = world;
}

LoadOptions load_options(const InitOptions& options) {
  LoadOptions load;
  load.world_size = options.group ? options.group->size() : 1;
  load.world_is_real = true;  // one process is a world of 1, not an unknown one
  load.autos = options.autos;
  load.extra_optimizers = optimizer_names();
  load.extra_schedulers = scheduler_names();
  return load;
}

}  // namespace

Config load_engine_config(const std::string& path, InitOptions& options) {
  connect(options);
  return load_config_file(path, load_options(options));
}

Config load_engine_config(const json& config, InitOptions& options) {
  connect(options);
  return parse_config_text(config.dump(), "<json passed to strata::initialize>",
                           load_options(options));
}

Engine::Engine(std::shared_ptr<torch::nn::Module> module, Config config, InitOptions options)
    : module_(std::move(module)),
      config_(std::move(config)),
      group_(std::move(options.group)),
      scaler_(LossScaler::from_config(config_.fp16)),
      last_grad_norm_(std::numeric_limits<double>::quiet_NaN()) {
  validate(options);
  // Ulysses: the model that shards its sequence asked for the same (cached) group.
  if (config_.sequence_parallel_size > 1)
    sequence_group_ = comm::sequence_group(group_, int(config_.sequence_parallel_size));
  prepare_module(options);
  build_groups(options);
  configure_lr_scheduler(options);
  follow_lr_schedule();
  start_monitors();
}

void Engine::validate(const InitOptions& options) {
  if (!module_) throw Error("strata::initialize: the model is empty (a null module holder)");
  // Before any offload, partition or step: a clear refusal instead of LibTorch's "not
  // implemented for 'Half'" (with a backtrace) in the first forward.
  {
    const auto params = module_->parameters();
    device_ = options.device.value_or(params.empty() ? torch::Device(torch::kCPU)
                                                     : params.front().device());
  }
  if (config_.fp16.enabled && !options.allow_fp16_on_cpu) {
    if (device_.is_cpu())
      throw Error(fmt::format(
          "{}: fp16.enabled = true, but the model is on the CPU, where LibTorch has no fp16 "
          "kernels for matrix products or LayerNorm; use bf16 (\"bf16\": {{\"enabled\": true}}, "
          "fp16 off; train_gpt: --precision bf16 with \"auto\") or train on a GPU",
          config_.source));
  }
  // Features this config asks for that this build's engine does not run yet: refuse rather
  // than train something other than what the config says.
  const auto pending = pending_features(config_);
  if (!pending.empty()) {
    std::string list;
    for (const auto& p : pending) list += "\n  " + p;
    throw Error(fmt::format("{}: this build of Strata cannot run this config yet:{}",
                            config_.source, list));
  }
  if (group_ && group_->size() != config_.world_size)
    throw Error(fmt::format("{}: the config was resolved for world size {}, the group has {}",
                            config_.source, config_.world_size, group_->size()));
  if (group_ && group_->size() == 1) group_.reset();
  if (group_) log::set_rank(group_->rank());
}

void Engine::prepare_module(const InitOptions& options) {
  // MoE layers: their experts differ from rank to rank (expert parallelism).
  find_experts();
  // Before anything is broadcast: every rank must hold the same tensors (experts: every rank
  // of their expert-data-parallel group).
  if (group_) {
    if (experts_.empty())
      check_same_model_on_every_rank(*module_, *group_);
    else
      check_same_model_on_every_rank(
          *module_, *group_, [names = expert_names()](const std::string& name) {
            return names.count(name) == 0;
          });
  }

  // Built inside a PartitionedInit: its tensors hold no bytes, only shards (stage 3 only).
  const auto& init = options.partitioned_init;
  if (init) {
    if (config_.zero_optimization.stage != 3)
      throw Error(fmt::format("{}: the model was built inside a PartitionedInit (partitioned "
                              "parameters), which needs zero_optimization.stage 3 (it is {})",
                              config_.source, config_.zero_optimization.stage));
    if (!experts_.empty())
      throw Error(fmt::format("{}: the model has MoE layers (expert parameter '{}') and was built "
                              "inside a PartitionedInit, which shards over the whole world; "
                              "experts are sharded over their expert-data-parallel group: build "
                              "the model outside it (stage 3 shards it at initialize)",
                              config_.source, experts_.front().name));
    init->finish();
    // Buffers and other tensors the model keeps get their bytes back; parameters stay shards.
    std::vector<torch::Tensor> params;
    for (const auto& p : unique_parameters(*module_, false)) params.push_back(p.tensor);
    init->restore_except(params);
  }
  auto partitioned = [&](const torch::Tensor& p) { return init && init->shard_of(p); };

  // Mixed precision: the module's floating-point parameters and buffers in 16 bits, as DeepSpeed
  // casts them (bool and integer buffers keep their dtype: model_check.h).
  const bool fp16 = config_.fp16.enabled, bf16 = config_.bf16.enabled;
  if (init) {
    const auto want = fp16 ? torch::kHalf : bf16 ? torch::kBFloat16 : torch::kFloat;
    for (const auto& p : unique_parameters(*module_, false))
      if (partitioned(p.tensor) && p.tensor.scalar_type() != want)
        throw Error(fmt::format(
            "{}: parameter '{}' was partitioned as {} by PartitionedInit, the config trains in {}; "
            "give PartitionedInit the config's dtype (PartitionedInitOptions::dtype)",
            config_.source, p.name, c10::toString(p.tensor.scalar_type()), c10::toString(want)));
  }
  {
    // Partitioned parameters already have the dtype (checked above): to() only aliases them,
    // and must not gather them.
    std::optional<at::DisableRecordFunctionGuard> quiet;
    if (init) quiet.emplace();
    if (fp16) cast_floating_point(*module_, torch::kHalf);
    if (bf16) cast_floating_point(*module_, torch::kBFloat16);
  }
  skip_on_overflow_ = fp16 || (bf16 && config_.bf16.check_grad_overflow);

  // Each tensor once, however many names it has (tied weights).
  const auto trainable = unique_parameters(*module_, /*trainable_only=*/true);
  if (trainable.empty())
    throw Error("strata::initialize: the model has no parameter that requires a gradient");
  check_one_device(trainable);
  for (const auto& p : trainable) params_.push_back(p.tensor);
  configure_autocast();
  if (device_.is_cpu()) {
    static std::once_flag logged;  // once per process, however many engines
    std::call_once(logged, [] {
      const auto threads = configure_cpu_threads(1);
      log::info("[strata] CPU: BLAS {}; {} thread(s) per rank of {} core(s){}",
                describe_cpu_blas(), threads.threads, threads.cores,
                threads.user_chosen ? " (OMP_NUM_THREADS)" : "");
    });
  }

  if (group_) {
    // Every rank starts from rank 0's parameters and buffers, as DeepSpeed and DDP do.
    torch::NoGradGuard no_grad;
    for (auto& p : unique_parameters(*module_, /*trainable_only=*/false))
      if (!partitioned(p.tensor) && !is_expert(p.tensor))  // else done already, or below
        group_->broadcast(p.tensor.detach(), 0);
    broadcast_buffers(*module_, *group_);
  }
  check_and_broadcast_experts();
  // InitOptions::device below stage 3: the checked model moves there whole (stage 3 moves it a
  // unit at a time: build_unit_groups).
  if (config_.zero_optimization.stage < 3) move_rest_to_device();
}

void Engine::move_rest_to_device() {
  // set_data keeps every TensorImpl (the optimizer's, the reducer's and autograd's handles).
  torch::NoGradGuard no_grad;
  at::DisableRecordFunctionGuard quiet;  // units' parameters are on the device already
  auto move = [&](torch::Tensor t) {
    if (t.defined() && t.device() != device_) t.set_data(t.to(device_));
  };
  for (const auto& p : module_->parameters(/*recurse=*/true)) move(p);
  for (const auto& b : module_->buffers(/*recurse=*/true)) move(b);
}

void Engine::start_monitors() {
  monitored_ = config_.tensorboard.enabled || config_.csv_monitor.enabled;
  monitor_ = monitor::make_monitors(config_, data_parallel_rank());
  // activation_checkpointing: what strata::checkpoint() in the model does (process-wide, as
  // deepspeed.checkpointing.configure).
  checkpointing::configure(this, config_, data_parallel_rank());
  exchanges_at_start_ = sequence::exchanges();
  tiled_calls_at_start_ = checkpointing::tiled_calls();  // this engine's model's calls are after
  for (const auto& w : config_.warnings) log::info("[strata] warning: {}", w);
}

Engine::~Engine() { checkpointing::release(this); }

std::shared_ptr<torch::optim::Optimizer> Engine::make_optimizer_over(
    std::vector<torch::Tensor> params, InitOptions& options) {
  const bool client = options.optimizer || options.optimizer_builder;
  if (config_.optimizer.present && client)
    throw Error(fmt::format(
        "{}: the config names optimizer '{}' and the program also passed an optimizer to "
        "strata::initialize; keep one (remove the config's \"optimizer\" block or the argument)",
        config_.source, config_.optimizer.type));
  if (options.optimizer && options.optimizer_builder)
    throw Error("strata::initialize: pass either InitOptions::optimizer or optimizer_builder");
  if (config_.optimizer.present) return make_optimizer(config_.optimizer, std::move(params));
  if (options.optimizer_builder) {
    std::shared_ptr<torch::optim::Optimizer> built = options.optimizer_builder(std::move(params));
    if (!built) throw Error("strata::initialize: optimizer_builder returned null");
    return built;
  }
  if (options.optimizer) {
    if (uses_partitioned_optimizer(config_))
      throw Error(fmt::format(
          "{}: with mixed precision or ZeRO the optimizer must run on the engine's fp32 master "
          "partition: pass InitOptions::optimizer_builder instead of an optimizer instance",
          config_.source));
    return std::move(options.optimizer);
  }
  throw Error(fmt::format(
      "{}: no optimizer: add an \"optimizer\" block (e.g. {{\"type\": \"AdamW\", \"params\": "
      "{{\"lr\": 1e-3}}}}) or pass one to strata::initialize",
      config_.source));
}

void Engine::configure_lr_scheduler(InitOptions& options) {
  const bool client = options.lr_scheduler || options.lr_scheduler_builder;
  if (config_.scheduler.present && client)
    throw Error(fmt::format(
        "{}: the config names scheduler '{}' and the program also passed one to "
        "strata::initialize; keep one",
        config_.source, config_.scheduler.type));
  if (options.lr_scheduler && options.lr_scheduler_builder)
    throw Error("strata::initialize: pass either InitOptions::lr_scheduler or its builder");
  if (config_.scheduler.present) {
    lr_scheduler_ = make_scheduler(config_.scheduler, *dense().optimizer());
  } else if (options.lr_scheduler_builder) {
    lr_scheduler_ = options.lr_scheduler_builder(*dense().optimizer());
  } else {
    lr_scheduler_ = std::move(options.lr_scheduler);  // may be null: constant lr
  }
  if (lr_scheduler_)
    for (const auto& w : lr_scheduler_->warnings()) log::info("[strata] warning: {}", w);
}

bool Engine::is_gradient_accumulation_boundary() const {
  return (micro_steps_ + 1) % gradient_accumulation_steps() == 0;
}

zero::ModelStateBytes Engine::model_state_bytes() const {
  zero::ModelStateBytes bytes;
  for (const auto& g : groups_) {
    const auto b = g->state_bytes();
    bytes.params += b.params, bytes.grads += b.grads, bytes.master += b.master;
    bytes.optimizer += b.optimizer, bytes.host += b.host, bytes.nvme += b.nvme;
  }
  return bytes;
}

std::vector<zero::ParamCoordinator*> Engine::coordinators() const {
  std::vector<zero::ParamCoordinator*> out;
  for (const auto& g : groups_)
    if (auto* c = g->coordinator()) out.push_back(c);
  return out;
}

std::vector<zero::ParamCoordinator::Scope> Engine::begin_forward() {
  // broadcast_buffers: rank 0's buffers before each training forward, as DDP does.
  if (config_.broadcast_buffers && group_ && torch::GradMode::is_enabled())
    broadcast_buffers(*module_, *group_);
  key_gate_noise();
  std::vector<zero::ParamCoordinator::Scope> scopes;
  for (auto* c : coordinators()) {
    c->rethrow_if_failed();
    scopes.emplace_back(c, zero::ParamCoordinator::Phase::kForward);
  }
  return scopes;
}

void Engine::end_forward() {
  for (auto* c : coordinators()) {
    c->end_forward();
    c->rethrow_if_failed();
  }
}

int64_t Engine::live_param_bytes_peak() const {
  if (dense().coordinator()) return last_live_peak_;
  int64_t bytes = 0;
  for (const auto& p : unique_parameters(*module_, /*trainable_only=*/false))
    bytes += p.tensor.numel() * p.tensor.element_size();
  return bytes;
}

std::shared_ptr<void> Engine::gathered_parameters() {
  if (!dense().coordinator()) return std::make_shared<int>(0);
  struct Gathered {
    explicit Gathered(zero::ParamCoordinator& c)
        : c(c), scope(&c, zero::ParamCoordinator::Phase::kGathered) {}
    ~Gathered() {
      c.unpin();
      c.release_all();
    }
    zero::ParamCoordinator& c;
    zero::ParamCoordinator::Scope scope;
  };
  std::vector<std::shared_ptr<Gathered>> all;
  for (auto* c : coordinators()) {
    c->rethrow_if_failed();
    all.push_back(std::make_shared<Gathered>(*c));
    c->pin({});
  }
  return std::make_shared<decltype(all)>(std::move(all));
}

void Engine::backward(const torch::Tensor& loss) {
  if (!loss.defined() || loss.numel() != 1)
    throw Error(fmt::format("Engine::backward: the loss must be a one-element tensor (got {})",
                            loss.defined() ? "shape " + c10::str(loss.sizes())
                                           : std::string("an undefined tensor")));
  const bool boundary = is_gradient_accumulation_boundary();
  if (monitored_) {
    const auto l = loss.detach().to(torch::kFloat).reshape({});
    window_loss_ = window_loss_.defined() ? window_loss_ + l : l;
  }
  for (const auto& g : groups_) g->begin_backward(boundary, loss, scaler_.cur_scale());
  // fp16: the loss scale; accumulation: 1/gas, so the window's gradients sum to the mean;
  // Ulysses: x sequence_parallel_size, so that the reduction's mean over every rank is the sum
  // over each sequence group (its ranks' losses are parts of one sample's) averaged over the
  // batch shards.
  const double factor = scaler_.cur_scale() * sequence_parallel_size() /
                        static_cast<double>(gradient_accumulation_steps());
  std::vector<zero::ParamCoordinator::Scope> scopes;
  for (auto* c : coordinators()) scopes.emplace_back(c, zero::ParamCoordinator::Phase::kBackward);
  if (factor != 1.0)
    (loss * factor).backward();
  else
    loss.backward();
  scopes.clear();
  for (const auto& g : groups_) g->end_backward();
  // activation_checkpointing.profile: each checkpointed function's times, logged and monitored.
  const auto profile = checkpointing::end_backward();
  if (profile.checkpoints > 0)
    write_monitor_events(
        {{"Train/ActivationCheckpointing/forward_ms", profile.forward_ms, global_samples()},
         {"Train/ActivationCheckpointing/recompute_ms", profile.recompute_ms, global_samples()},
         {"Train/ActivationCheckpointing/input_MiB", profile.input_bytes / 1048576.0,
          global_samples()}});
  // activation_checkpointing.mlp_tiles is the model's to act on: said once when it did not.
  if (!tiling_checked_) {
    tiling_checked_ = true;
    // Ulysses: a model that never exchanged attended within its shard only; its gradients are
    // another model's. Refused before the first step.
    if (sequence_parallel_size() > 1 && sequence::exchanges() == exchanges_at_start_)
      throw Error(fmt::format(
          "{}: sequence_parallel_size is {} but the model's first forward ran no Ulysses attention "
          "exchange: each rank attended within its own shard of the sequence. Call "
          "strata::sequence::ulysses_attention with engine->sequence_parallel_group() in the "
          "model's attention (models::CausalLM and examples::GPT do it after "
          "set_sequence_parallel), or drop the key",
          config_.source, sequence_parallel_size()));
    const int64_t tiles = checkpointing::settings().mlp_tiles;
    if (tiles >= 0 && checkpointing::tiled_calls() == tiled_calls_at_start_)
      log::info("[strata] warning: activation_checkpointing.mlp_tiles is {} but the model ran no "
                "tiled computation in its first forward: a model tiles its feed-forward by "
                "calling strata::checkpointing::tiled() with settings().mlp_tiles "
                "(runtime/util/tiled.h; the example GPT and models/ do)",
                tiles);
  }
  for (auto* c : coordinators()) {
    c->release_all();  // the units backward used last (the first layers)
    c->end_micro_step();
    c->rethrow_if_failed();
  }
}

void Engine::step() {
  for (auto* c : coordinators()) c->rethrow_if_failed();
  for (const auto& g : groups_) g->end_micro_step();
  if (is_gradient_accumulation_boundary()) {
    // Before any weight changes: did every rank gather the same units?
    for (auto* c : coordinators()) c->check_same_gathers();
    optimizer_step();
    balance_experts();
    if (dense().coordinator()) last_live_peak_ = 0;
    if (expert_window_bytes_ > 0) last_expert_peak_ = stage3_expert_coordinator()->live_bytes_peak();
    for (auto* c : coordinators()) {  // experts and the rest: each one's peak (an upper bound)
      last_live_peak_ += c->live_bytes_peak();
      c->reset_peak();
    }
    ++global_steps_;
    if (monitored_) write_step_events();
    if (config_.steps_per_print > 0 && global_steps_ % config_.steps_per_print == 0) log_step();
  }
  ++micro_steps_;
}

void Engine::write_step_events() {
  // The window's mean loss over every rank (a collective: every rank takes part). Ulysses: a
  // sequence group's ranks hold parts of one sample's loss, so the mean over ranks x sp.
  auto loss = window_loss_.defined()
                  ? window_loss_ * (double(sequence_parallel_size()) /
                                    double(gradient_accumulation_steps()))
                  : torch::zeros({});
  window_loss_ = torch::Tensor();
  if (group_) group_->all_reduce(loss, comm::ReduceOp::Avg);
  if (!monitors_enabled()) return;
  const int64_t x = global_samples();
  std::vector<monitor::Event> events = {
      {"Train/Samples/train_loss", loss.item<double>(), x},
      {"Train/Samples/lr", get_lr().at(0), x},
      {"Train/Samples/loss_scale", loss_scale(), x},
      {"Train/Samples/model_state_MiB", model_state_bytes().total() / 1048576.0, x},
      {"Train/Samples/live_param_MiB_peak", live_param_bytes_peak() / 1048576.0, x}};
  if (!std::isnan(last_grad_norm_)) events.push_back({"Train/Samples/grad_norm", last_grad_norm_, x});
  monitor_->write_events(events);
}

void Engine::write_monitor_events(const std::vector<monitor::Event>& events) {
  if (monitors_enabled()) monitor_->write_events(events);
}

void Engine::settle_step() {
  for (const auto& g : groups_) {
    g->settle();
    // offload_optimizer.ratio: the device share's state into the host master and moments, which
    // the caller is about to read.
    if (auto* p = g->partitioned()) p->store_device_share();
  }
}

void Engine::optimizer_step() {
  // One global norm over every group's gradients, each counted once (the experts' over their
  // expert-parallel group), as torch.nn.utils.clip_grad_norm_ and DeepSpeed; one overflow
  // decision for all. The plain fp32 path measures the norm only for clipping.
  const bool clipping = config_.gradient_clipping.value > 0.0;
  zero::GradientSummary summary;
  double squares = 0.0;
  for (const auto& g : groups_) {
    const auto s = g->prepare(scaler_.cur_scale(), /*need_norm=*/clipping);
    summary.overflow = summary.overflow || s.overflow;
    summary.grad_norm = s.grad_norm;
    squares += s.grad_norm * s.grad_norm;  // NaN when a group did not measure it
  }
  if (groups_.size() > 1) summary.grad_norm = std::sqrt(squares);
  last_grad_norm_ = summary.grad_norm;
  last_step_skipped_ = summary.overflow && skip_on_overflow_;
  if (last_step_skipped_) {
    // As DeepSpeed: no parameter, optimizer-state or LR-schedule change; the scale drops
    // (or the run ends with an error at the minimum scale).
    const auto update = scaler_.update_scale(true);
    for (const auto& g : groups_) g->discard();
    ++skipped_steps_;
    log::info("[strata] step {}: gradient overflow, step skipped; {}", global_steps_ + 1,
              describe(update));
    return;
  }
  scaler_.update_scale(false);
  double clip_coef = 1.0;
  if (clipping) clip_coef = config_.gradient_clipping.value / (summary.grad_norm + 1e-6);
  for (const auto& g : groups_) g->apply(clip_coef);
  if (lr_scheduler_) lr_scheduler_->step();
  follow_lr_schedule();
}

// The dense optimizer's groups, then the experts' (DeepSpeed-MoE keeps experts in groups of their
// own): every group a step will use.
std::vector<double> Engine::get_lr() const {
  std::vector<double> lrs;
  for (const auto& g : groups_)
    for (auto& group : g->optimizer()->param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

void Engine::log_step() const {
  std::string lrs;
  for (double lr : get_lr()) lrs += fmt::format("{}{:.4e}", lrs.empty() ? "" : ", ", lr);
  if (std::isnan(last_grad_norm_))
    log::info("[strata] step={}, samples={}, lr=[{}]", global_steps_, global_samples(), lrs);
  else
    log::info("[strata] step={}, samples={}, lr=[{}], grad_norm={:.4f}", global_steps_,
              global_samples(), lrs, last_grad_norm_);
}

}  // namespace strata
