// Config blocks Strata reads so that a real DeepSpeed config loads, but whose features it does not
// implement, or only observes: profilers, loggers, DeepSpeed-only engines. Included by config.h.
// The member initialisers are the defaults, as in config.h; schema_monitor.cpp and
// schema_misc.cpp bind the JSON keys to them and say what happens when one is set.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata {

using json = nlohmann::json;

// A block validated shallowly: its first-level keys are known and type-checked (in its schema
// table), `enabled` is bound where the block has one, every other given key is kept in
// `settings` as written. Used for DeepSpeed features whose inner structure Strata never reads.
struct ShallowConfig {
  bool enabled = false;
  json settings = json::object();
};

struct CometConfig {
  bool enabled = false;
  int64_t samples_log_interval = 100;
  std::optional<std::string> project;
  std::optional<std::string> workspace;
  std::optional<std::string> api_key;
  std::optional<std::string> experiment_name;
  std::optional<std::string> experiment_key;
  std::optional<bool> online;
  std::optional<std::string> mode;
};

struct FlopsProfilerConfig {
  bool enabled = false;
  double recompute_fwd_factor = 0.0;
  int64_t profile_step = 1;
  int64_t module_depth = -1;
  int64_t top_modules = 1;
  bool detailed = true;
  std::optional<std::string> output_file;
};

struct CommsLoggerConfig {
  bool enabled = false;
  bool verbose = false;
  bool prof_all = true;
  bool debug = false;
  std::vector<std::string> prof_ops;
};

struct ThroughputTimerConfig {
  bool enabled = true;
  bool synchronized = true;
};

struct TimersConfig {
  ThroughputTimerConfig throughput;
};

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool contiguous_memory_optimization = false;
  bool cpu_checkpointing = false;
  std::optional<int64_t> number_checkpoints;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
  // Strata's own: checkpointed inputs in swap files under this folder (io_uring store); "": off.
  std::string nvme_path;
  // Strata's own: the models' feed-forward over tiles of the sequence (runtime/util/tiled.h);
  // absent: untiled, 0: ceil(seq / hidden) tiles (ALST's count), N: N tiles.
  std::optional<int64_t> mlp_tiles;
};

struct CheckpointParallelWriteConfig {
  bool pipeline_stage = false;
};

struct CheckpointConfig {
  std::string tag_validation = "Warn";  // Ignore | Warn | Fail
  bool load_universal = false;
  bool use_node_local_storage = false;
  CheckpointParallelWriteConfig parallel_write;
};

struct DataTypesConfig {
  std::optional<std::string> grad_accum_dtype;  // fp32 | fp16 | bf16; unset = the model's
  std::optional<std::string> param_dtype;
  std::optional<std::string> buffer_dtype;
};

struct TorchAutocastConfig {
  bool enabled = false;
  std::string dtype = "bfloat16";
  std::optional<std::vector<std::string>> lower_precision_safe_modules;
};

}  // namespace strata
