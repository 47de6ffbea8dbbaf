// The typed training config: DeepSpeed's JSON schema (key names, legacy spellings, defaults) as
// C++ structs. The member initialisers below ARE the defaults; the schema tables in
// runtime/config/schema_*.cpp bind JSON keys to these members, and parsing, validation,
// "did you mean", "auto" resolution and strata-config's printout all come from those tables.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace strata {

using json = nlohmann::json;

// A numeric value that may be written "auto" (Hugging Face's DeepSpeed integration): resolved
// from what the program passes (AutoValues) or from the rest of the config.
template <class T>
struct Autoable {
  T value{};
  bool is_auto = false;
};

struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0.0;  // 0 = dynamic
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool fp16_master_weights_and_grads = false;
};

struct Bf16Config {
  bool enabled = false;
  bool immediate_grad_update = false;
  bool check_grad_overflow = false;
  bool bf16_master_weights_and_grads = false;
  bool bf16_optimizer_states = false;
};

struct OffloadParamConfig {
  std::string device = "none";  // none | cpu | nvme
  std::string nvme_path;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  bool pin_memory = true;  // DeepSpeed's default since 0.19.5
};

struct OffloadOptimizerConfig {
  std::string device = "none";  // none | cpu | nvme
  std::string nvme_path;
  int64_t buffer_count = 4;
  bool pin_memory = true;  // DeepSpeed's default since 0.19.5
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;
  bool super_offload = false;
  bool convert_grad_on_cpu = true;
  double cpuadam_cores_perc = 0.8;
  int64_t max_in_cpu = 0;  // Strata's own: state elements kept in host memory with device nvme
};

// zero_optimization.zenflow (DeepSpeed's ZenFlow, docs/zenflow.md): the top columns of each
// weight's gradient stepped on the device every step, the rest by the CPU every update_interval
// steps. Strata runs a subset (schema_zero.cpp says which, and why, for the rest).
struct ZenFlowConfig {
  bool enabled = false;  // the block is present
  double topk_ratio = 0.1;
  std::string select_strategy = "auto";
  json select_interval = "auto";  // an integer or "auto", checked when the block is read
  json update_interval = "auto";
  bool overlap_step = false;
  bool offload = false;
  double auto_ratio = 0.99;
  int64_t full_warm_up_rounds = 0;
  double pt_reserved_cores_perc = 0.5;
};

struct ZeroConfig {
  int64_t stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  Autoable<int64_t> reduce_bucket_size{500000000};
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500000000;
  std::optional<bool> overlap_comm;  // DeepSpeed: unset = true at stage 3, false below
  bool load_from_fp32_weights = true;
  bool elastic_checkpoint = false;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  int64_t sub_group_size = 1000000000;
  Autoable<int64_t> stage3_prefetch_bucket_size{50000000};
  Autoable<int64_t> stage3_param_persistence_threshold{100000};
  int64_t stage3_model_persistence_threshold = INT64_MAX;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool ignore_unused_parameters = true;
  bool round_robin_gradients = false;
  int64_t zero_hpz_partition_size = 1;
  bool zero_quantized_weights = false;
  bool zero_quantized_nontrainable_weights = false;
  bool zero_quantized_gradients = false;
  int64_t mics_shard_size = -1;
  bool mics_hierarchical_params_gather = false;
  bool memory_efficient_linear = true;
  bool log_trace_cache_warnings = false;
  // Tuning knobs of DeepSpeed's own ZeRO implementation (accepted; see schema_zero.cpp).
  bool use_multi_rank_bucket_allreduce = true;
  bool compute_grad_norm = true;
  bool parameter_alignment = false;
  int64_t stage3_module_granularity_threshold = 0;
  bool stage3_use_all_reduce_for_fetch_params = false;
  bool stage3_allgather_sequential = false;
  int64_t stage3_partition_stream_chunk_size = 0;
  bool legacy_stage1 = false;
  bool pipeline_loading_checkpoint = false;
  bool override_module_apply = true;
  bool enable_sanity_checks = false;
  bool save_muon_momentum_buffer_in_memory = false;
  json zeropp_loco_param;  // null = off
  json leaf_module;        // null = none
  ZenFlowConfig zenflow;

  bool overlap_comm_resolved() const { return overlap_comm.value_or(stage == 3); }
};

struct AioConfig {
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;  // legacy spelling: thread_count
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
};

// optimizer / scheduler: the type picks an entry in a registry; params are checked against that
// type's schema (built-in types) and arrive with every default filled in and every "auto"
// resolved, so a factory reads params.at("lr") without a second copy of the defaults.
struct OptimizerConfig {
  bool present = false;
  // Built-in types are normalised: "adamw" (Adam with adam_w_mode true, DeepSpeed's default),
  // "adam" (adam_w_mode false), "sgd". Types registered by the program stay as written.
  std::string type;
  json params = json::object();
  bool legacy_fusion = false;
};

struct SchedulerConfig {
  bool present = false;
  std::string type;  // built-ins in DeepSpeed's spelling: WarmupLR, WarmupCosineLR, ...
  json params = json::object();
};

struct MonitorConfig {  // tensorboard, csv_monitor, wandb (observer-only)
  bool enabled = false;
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";
  // wandb's keys (the tensorboard / csv_monitor tables do not bind them)
  std::optional<std::string> group;
  std::optional<std::string> team;
  std::string project = "deepspeed";
};

// Strata's `launcher` block, read by strata-run --config (the engine ignores it). Zero or empty
// means "not given": the launcher's own default applies, and a command-line flag always wins.
struct LauncherConfig {
  std::string hostfile;
  std::string include;
  std::string exclude;
  int64_t num_nodes = 0;
  int64_t num_gpus = 0;
  std::string master_addr;
  int64_t master_port = 0;
  // Set on every rank and carried to remote hosts: NAME (this environment's value), NAME_*
  // (every variable with that prefix) or NAME=VALUE.
  std::vector<std::string> export_env;
};

struct MoeConfig {
  int64_t num_experts = 1;
  int64_t ep_size = 1;
  int64_t top_k = 1;
  double capacity_factor = 1.0;
  double eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;
  bool drop_tokens = true;
  bool use_rts = true;
  std::string noisy_gate_policy = "None";  // None | Jitter | RSample
  double aux_loss_coef = 0.01;
  bool top2_2nd_expert_sampling = true;  // DeepSpeed's TopKGate default
  std::string drop_policy = "probs";     // probs | position (top-k >= 3)
  double router_z_loss_coef = 0.0;       // ST-MoE's router z-loss; 0: off
  bool use_residual = false;             // DeepSpeed's Residual MoE (PR-MoE)
  // DeepSeek-V3's router (moe/gate.h): sigmoid scores, top-k on score + a balancing bias moved
  // after each optimizer step, experts in groups, shared experts beside the routed ones.
  std::string score_func = "softmax";  // softmax | sigmoid
  double bias_update_speed = 0.0;      // the bias's step toward balance; 0: no bias
  int64_t n_group = 1;                 // expert groups (group-limited routing)
  int64_t topk_group = 1;              // groups each token may route to (with n_group > 1)
  bool norm_topk_prob = true;          // sigmoid: the k chosen scores normalised to sum 1
  double route_scale = 1.0;            // sigmoid: combine weights scaled by this
  int64_t n_shared_experts = 0;        // always-on experts: one MLP of n x the expert FFN
  // Streamed experts (moe/experts.h): ZeRO-3 gathers a layer's experts in units of this many
  // (0: one unit of all a rank's experts), at most expert_window units of them at once.
  int64_t expert_unit_size = 0;
  int64_t expert_window = 2;
  // Expert parallelism: the exchanges the local experts' rows are cut into (moe/exchange.h).
  int64_t exchange_chunks = 1;
  // The block's keys the file gave (canonical names). A program that builds its layers from its
  // own model fills the others from the model (examples/gpt_moe.cpp); the engine checks that the
  // model's MoE layers follow every given key (runtime/engine_experts.cpp).
  std::set<std::string> given;
};

}  // namespace strata

// Blocks Strata validates but does not (fully) implement: monitors, profilers, DeepSpeed features.
#include "runtime/config/config_blocks.h"

namespace strata {

struct Config {
  std::string source;  // file name, for messages

  Autoable<int64_t> train_batch_size;
  Autoable<int64_t> train_micro_batch_size_per_gpu;
  Autoable<int64_t> gradient_accumulation_steps;
  int64_t steps_per_print = 10;
  Autoable<double> gradient_clipping{0.0};
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  std::string communication_data_type;  // "" = the precision's default
  bool wall_clock_breakdown = false;
  bool memory_breakdown = false;
  bool zero_allow_untested_optimizer = false;
  bool zero_force_ds_cpu_optimizer = true;
  bool dump_state = false;
  bool sparse_gradients = false;
  bool disable_allgather = false;
  bool dataloader_drop_last = false;
  std::string seq_parallel_comm_data_type = "fp32";
  int64_t sequence_parallel_size = 1;
  std::optional<int64_t> vocabulary_size;
  bool graph_harvesting = false;
  bool managed_gradient_accumulation = true;
  std::string gradient_allreduce_op = "mean";
  bool use_data_before_expert_parallelism = false;
  bool disable_python_gc = false;
  bool broadcast_buffers = false;  // Strata's own: DDP's broadcast_buffers

  Fp16Config fp16;
  Bf16Config bf16;  // legacy block name: bfloat16
  ZeroConfig zero_optimization;
  AioConfig aio;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  MonitorConfig tensorboard;
  MonitorConfig csv_monitor;
  MonitorConfig wandb;
  MoeConfig moe;
  LauncherConfig launcher;

  // Validated, not (fully) implemented: see config_blocks.h and the schema_*.cpp tables.
  CometConfig comet;
  FlopsProfilerConfig flops_profiler;
  CommsLoggerConfig comms_logger;
  TimersConfig timers;
  ActivationCheckpointingConfig activation_checkpointing;
  CheckpointConfig checkpoint;
  DataTypesConfig data_types;
  ShallowConfig amp;
  TorchAutocastConfig torch_autocast;
  ShallowConfig compile;  // enabled = "deepcompile"
  ShallowConfig tensor_parallel;
  ShallowConfig hybrid_engine;
  ShallowConfig eigenvalue;
  ShallowConfig progressive_layer_drop;
  ShallowConfig autotuning;
  ShallowConfig compression_training;
  ShallowConfig curriculum_learning;
  ShallowConfig data_efficiency;
  ShallowConfig elasticity;
  ShallowConfig pipeline;
  ShallowConfig quantize_training;
  ShallowConfig nebula;
  json sparse_attention;     // null = absent
  json expert_parallel;      // DeepSpeed's AutoEP; null = absent
  json weight_quantization;  // inference-only; null = absent
  json datastates;           // checkpoint engine; null = absent

  // Messages about keys that only observe (profilers, wandb, ...) or are deprecated.
  std::vector<std::string> warnings;

  int64_t world_size = 1;  // the data-parallel world the batch triangle was checked against

  // JSON paths still written "auto" (only with LoadOptions::allow_unresolved_auto); to_json
  // prints "auto" there.
  std::vector<std::string> unresolved_autos;

  // Each value the program supplied (LoadOptions::autos): an "auto" resolved, or a batch key the
  // file left out. `from` names the AutoValues member(s) read ("lr", "beta1, beta2"), or is
  // empty for HF's constants and for train_batch_size derived from the other two; a program maps
  // it to its own setting to say where each value came from.
  struct Filled {
    std::string path;
    json value;
    std::string from;
  };
  std::vector<Filled> filled;
};

// Values a program passes for "auto" entries, as Hugging Face's Trainer passes its
// TrainingArguments. An "auto" with no value to resolve it from is an error naming the key.
struct AutoValues {
  std::optional<int64_t> micro_batch_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<double> lr;
  std::optional<double> beta1, beta2, eps, weight_decay;
  std::optional<double> max_grad_norm;
  std::optional<int64_t> warmup_steps;
  std::optional<int64_t> total_steps;
  std::optional<bool> fp16, bf16;
  std::optional<int64_t> hidden_size;  // for bucket sizes, as HF derives them from the model
};

// strata-config's --auto NAME=VALUE: sets the AutoValues member NAME ("lr", "hidden_size", ...).
// Returns "" on success, else what was wrong with the assignment.
std::string set_auto_value(AutoValues& autos, const std::string& assignment);

struct LoadOptions {
  int64_t world_size = 1;
  // world_size is the real world (the engine's), not a tool's stand-in 1: checks that a world of
  // 1 would pass vacuously (moe.ep_size divides it) apply at 1 too.
  bool world_is_real = false;
  AutoValues autos;
  // Names a program registered beyond the built-in optimizers / schedulers: accepted as types,
  // their params passed through unchecked for their factory to validate.
  std::vector<std::string> extra_optimizers;
  std::vector<std::string> extra_schedulers;
  // strata-config check has no program: leave unresolvable "auto"s (optimizer/scheduler values)
  // unresolved with a warning instead of an error.
  bool allow_unresolved_auto = false;
  // strata-run reads the launcher block before it knows the world size: it checks the batch
  // triangle in a second pass, once the world is planned.
  bool check_batch_triangle = true;
};

// Every problem found in one pass, each naming the JSON path; what() joins them one per line,
// each line prefixed with the source file name (and line:column where known).
class ConfigError : public Error {
 public:
  ConfigError(std::string source, std::vector<std::string> problems);
  const std::string& source() const { return source_; }
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  std::string source_;
  std::vector<std::string> problems_;
};

Config parse_config_text(const std::string& text, const std::string& source,
                         const LoadOptions& options = {});
Config load_config_file(const std::string& path, const LoadOptions& options = {});
// The resolved config as JSON, every key with its value (defaults included), DeepSpeed spellings.
json to_json(const Config& config);

// Valid settings this build's engine does not run yet (ZeRO stage >= 1, offload, fp16/bf16, MoE),
// one line each naming the key: the engine throws with them; strata-config check warns.
std::vector<std::string> pending_features(const Config& config);

}  // namespace strata
