// The schema tables, one getter per block, each defined in the schema_<block>.cpp file that owns
// it. root_block() (schema_top.cpp) assembles them into the table of Config.
#pragma once

#include "runtime/config/schema.h"

namespace strata::schema {

const Block& root_block();  // schema_top.cpp

const Block& fp16_block();  // schema_precision.cpp
const Block& bf16_block();
const Block& amp_block();
const Block& torch_autocast_block();

const Block& zero_block();  // schema_zero.cpp

const Block& optimizer_block();  // schema_optimizer.cpp
// The params tables of the built-in types (names "optimizer.params (Adam)", ...).
std::vector<const Block*> optimizer_params_blocks();
const Block& scheduler_block();  // schema_scheduler.cpp
std::vector<const Block*> scheduler_params_blocks();

const Block& tensorboard_block();  // schema_monitor.cpp
const Block& csv_monitor_block();
const Block& wandb_block();
const Block& comet_block();
const Block& flops_profiler_block();
const Block& comms_logger_block();
const Block& timers_block();

const Block& aio_block();  // schema_misc.cpp
const Block& activation_checkpointing_block();
const Block& checkpoint_block();
const Block& data_types_block();
const Block& compile_block();
const Block& tensor_parallel_block();
const Block& hybrid_engine_block();
const Block& eigenvalue_block();
const Block& progressive_layer_drop_block();
const Block& pipeline_block();
const Block& nebula_block();

const Block& autotuning_block();  // schema_features.cpp: deep DeepSpeed features, read shallowly
const Block& compression_training_block();
const Block& curriculum_learning_block();
const Block& data_efficiency_block();
const Block& elasticity_block();
const Block& quantize_training_block();

const Block& moe_block();  // schema_moe.cpp

const Block& launcher_block();  // schema_launcher.cpp

// One first-level key of a shallow block: its name, kind and DeepSpeed's meaning.
struct ShallowKey {
  const char* key;
  Kind kind;
  const char* what;
};

// A block read shallowly into a ShallowConfig: `enabled` with the given support level and meaning,
// the other first-level keys type-checked and kept as written (schema_misc.cpp).
Block shallow_block(const char* name, Support support, const char* why, const char* enabled_what,
                    std::vector<ShallowKey> keys);

}  // namespace strata::schema
